"""Loading onto the host: every tensor byte-identical to gguf-py's reader, in every load
mode; progress; cancellation and closing release everything."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from service.errors import ByteOrderError, LoadCancelledError, RequestError
from service.loader.model import LoadedModel
from service.loader.pipeline import Progress, load_model
from service.loader.weights import open_model
from tests.helpers import Fixture, mixed_tensors, write_fixture
from tests.resources import fds_on, load_threads, mappings_of
from tests.samples import FACTS, ORACLE, tensor_data_span

MODES = ["mmap", "none"]


def assert_matches_reader(model: LoadedModel, reader: Any) -> None:
    """Every tensor of ``model`` has the bytes, type and shape gguf-py reads."""
    assert len(model) == len(reader.tensors)
    for ref in reader.tensors:
        t = model[ref.name]
        assert t.ggml_type == ref.tensor_type.name
        assert t.ne == tuple(int(d) for d in ref.shape)
        assert t.nbytes == int(ref.n_bytes)
        assert t.data.nbytes == t.nbytes
        assert t.data.tobytes() == np.asarray(ref.data).tobytes(), ref.name


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fixture_name", ["all_types_fixture", "aligned_fixture"])
async def test_bytes_match_gguf_py(fixture_name: str, mode: str, request: pytest.FixtureRequest) -> None:
    fx: Fixture = request.getfixturevalue(fixture_name)
    with await load_model(open_model(fx.path), load_mode=mode) as model:
        assert_matches_reader(model, gguf.GGUFReader(fx.path))
        expected_type = "CPU_Mapped" if mode == "mmap" else "CPU"
        assert {t.buffer_type for t in model} == {expected_type}
        assert {b.buffer_type for b in model.report.buffers} == {expected_type}


@pytest.mark.parametrize("mode", MODES)
async def test_typed_views_hold_the_written_values(all_types_fixture: Fixture, mode: str) -> None:
    with await load_model(open_model(all_types_fixture.path), load_mode=mode) as model:
        for name, (data, qtype) in all_types_fixture.tensors.items():
            t = model[name]
            if qtype.name in ("F32", "F16", "I32"):
                assert t.data.dtype == data.dtype
                np.testing.assert_array_equal(t.data, data)
            else:
                assert t.data.dtype == np.uint8
                assert t.data.shape == data.shape


@pytest.mark.sample
@pytest.mark.parametrize("mode", MODES)
async def test_sample_model_bytes_match_gguf_py(sample_path: Path, sample_reader: Any, mode: str) -> None:
    # every tensor in one CPU context: the mapped range, or the tensors packed at the
    # file's alignment, covers the tensor data as the file lays it out
    span = tensor_data_span(sample_reader)
    with await load_model(open_model(sample_path), load_mode=mode) as model:
        assert_matches_reader(model, sample_reader)
        assert model.report.total_nbytes == model.index.nbytes == span
        assert model.report.lines() == [
            f"{'CPU_Mapped' if mode == 'mmap' else 'CPU':>12} model buffer size = {span / (1 << 20):8.2f} MiB"
        ]


@pytest.mark.parametrize("mode", MODES)
async def test_progress_is_monotonic_and_complete(aligned_fixture: Fixture, mode: str) -> None:
    index = open_model(aligned_fixture.path)
    seen: list[Progress] = []
    with await load_model(index, load_mode=mode, on_progress=seen.append, chunk_nbytes=64):
        pass
    done = [p.bytes_done for p in seen]
    assert done[0] == 0 and done[-1] == index.nbytes
    assert all(b > a for a, b in zip(done, done[1:], strict=False))
    assert {p.bytes_total for p in seen} == {index.nbytes}
    assert len(seen) > len(index)  # chunks smaller than tensors report inside a tensor


async def test_progress_reaches_the_loop_in_batches(aligned_fixture: Fixture) -> None:
    # a slow callback: chunks finish while the loop is busy with the last one; each
    # still gets its callback, in order, but they cross to the loop together (and at
    # most once every PROGRESS_POST_SECONDS)
    loop = asyncio.get_running_loop()
    index = open_model(aligned_fixture.path)
    wakeups = [0]
    posted = loop.call_soon_threadsafe

    def counting(callback: Any, *args: Any, **kwargs: Any) -> Any:
        wakeups[0] += 1
        return posted(callback, *args, **kwargs)

    seen: list[int] = []

    def slow(p: Progress) -> None:
        seen.append(p.bytes_done)
        time.sleep(0.002)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    try:
        with await load_model(index, load_mode="none", on_progress=slow, chunk_nbytes=64):
            pass
    finally:
        del loop.call_soon_threadsafe
    assert seen[-1] == index.nbytes and all(b > a for a, b in zip(seen, seen[1:], strict=False))
    assert len(seen) > len(index)
    assert wakeups[0] < len(seen) - 1  # the final result is one more post


async def test_a_raising_progress_callback_loses_no_chunk(aligned_fixture: Fixture) -> None:
    # chunks batched together each get their callback even when one of them raises: the
    # loop's exception handler hears of each failure, the load goes on, the last call
    # reports the total, and nothing is called after load_model returns
    loop = asyncio.get_running_loop()
    index = open_model(aligned_fixture.path)
    failures: list[BaseException | None] = []
    loop.set_exception_handler(lambda _, context: failures.append(context.get("exception")))
    seen: list[int] = []

    def flaky(p: Progress) -> None:
        seen.append(p.bytes_done)
        time.sleep(0.002)  # chunks pile up while the loop is here
        if len(seen) % 3 == 2:
            raise RuntimeError(f"callback {len(seen)}")

    try:
        model = await load_model(index, load_mode="none", on_progress=flaky, chunk_nbytes=64)
        calls = len(seen)
        await asyncio.sleep(0.05)
        model.close()
    finally:
        loop.set_exception_handler(None)
    assert len(seen) == calls
    assert seen[-1] == index.nbytes and all(b > a for a, b in zip(seen, seen[1:], strict=False))
    assert [str(e) for e in failures] == [f"callback {n}" for n in range(2, calls + 1, 3)]
    assert fds_on(aligned_fixture.path) == 0 and load_threads() == 0


def test_memory_report_lines_follow_llama_cpp_format() -> None:
    from service.loader.model import BufferInfo, MemoryReport

    report = MemoryReport(
        (
            BufferInfo("CPU_Mapped", "CPU", 246587904, mapped=True, host=True),
            BufferInfo("CPU", "CPU", 1 << 20, mapped=False, host=True),
        )
    )
    assert report.lines() == [
        "  CPU_Mapped model buffer size =   235.16 MiB",
        "         CPU model buffer size =     1.00 MiB",
    ]
    assert report.to_dict()["by_device"] == {"CPU": {"CPU_Mapped": 246587904, "CPU": 1 << 20}}
    assert report.total_nbytes == 246587904 + (1 << 20)


@pytest.mark.parametrize("mode", MODES)
async def test_close_releases_mappings_and_files(aligned_fixture: Fixture, mode: str) -> None:
    path = aligned_fixture.path
    model = await load_model(open_model(path), load_mode=mode)
    if mode == "mmap":
        assert mappings_of(path) >= 1
    assert fds_on(path) == 0  # the data is mapped or copied; no descriptor stays open
    model.close()
    model.close()  # idempotent
    assert mappings_of(path) == 0 and fds_on(path) == 0
    assert model.closed
    assert all(t.data.nbytes == 0 for t in model)


@pytest.mark.parametrize("mode", MODES)
async def test_cancel_from_the_progress_callback(aligned_fixture: Fixture, mode: str) -> None:
    path = aligned_fixture.path
    calls = 0

    def stop_after_two(_: Progress) -> bool:
        nonlocal calls
        calls += 1
        return calls < 3

    with pytest.raises(LoadCancelledError):
        await load_model(open_model(path), load_mode=mode, on_progress=stop_after_two, chunk_nbytes=32)
    assert mappings_of(path) == 0 and fds_on(path) == 0 and load_threads() == 0


@pytest.mark.parametrize("mode", MODES)
async def test_cancel_the_task_mid_load(tmp_path: Path, mode: str) -> None:
    rng = np.random.default_rng(5)
    big = {
        f"blk.{i}.w": (rng.standard_normal(1 << 18).astype(np.float32), gguf.GGMLQuantizationType.F32) for i in range(8)
    }
    path = write_fixture(tmp_path / "big.gguf", tensors=big).path
    started = asyncio.Event()

    def on_progress(p: Progress) -> None:
        if p.bytes_done > 0:
            started.set()

    task = asyncio.create_task(load_model(open_model(path), load_mode=mode, on_progress=on_progress, chunk_nbytes=4096))
    await asyncio.wait_for(started.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert mappings_of(path) == 0 and fds_on(path) == 0 and load_threads() == 0


async def test_big_endian_data_is_refused(tmp_path: Path) -> None:
    fx = write_fixture(tmp_path / "be.gguf", tensors=mixed_tensors(4), endian=gguf.GGUFEndian.BIG)
    index = open_model(fx.path)
    assert index.byte_order == "big"
    with pytest.raises(ByteOrderError, match="big-endian") as info:
        await load_model(index)
    assert "gguf-convert-endian" in str(info.value)


async def test_unknown_load_mode(all_types_fixture: Fixture) -> None:
    with pytest.raises(RequestError, match="unknown load mode 'fast'"):
        await load_model(open_model(all_types_fixture.path), load_mode="fast")


@pytest.mark.parametrize("mode", MODES)
async def test_every_chunk_size_gives_the_same_bytes(aligned_fixture: Fixture, mode: str) -> None:
    index = open_model(aligned_fixture.path)
    with await load_model(index, load_mode=mode) as whole:
        expected = {name: t.data.tobytes() for name, t in whole.tensors.items()}
    for chunk in [1, 3, 7, 31, 32, 33, 100, 1000, 4096]:
        with await load_model(index, load_mode=mode, chunk_nbytes=chunk) as model:
            assert {name: t.data.tobytes() for name, t in model.tensors.items()} == expected, chunk


async def test_short_reads_are_retried(aligned_fixture: Fixture, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    real = os.preadv
    calls = 0

    def short_preadv(fd: int, buffers: list[Any], offset: int) -> int:
        nonlocal calls
        calls += 1
        view = memoryview(buffers[0])[:5]  # never more than 5 bytes at a time
        return real(fd, [view], offset)

    index = open_model(aligned_fixture.path)
    with await load_model(index, load_mode="mmap") as ref:
        expected = {name: t.data.tobytes() for name, t in ref.tensors.items()}
    monkeypatch.setattr(os, "preadv", short_preadv)
    with await load_model(index, load_mode="none") as model:
        assert {name: t.data.tobytes() for name, t in model.tensors.items()} == expected
    assert calls >= index.nbytes // 5


async def test_file_shrinking_during_load_is_a_clear_error(tmp_path: Path, aligned_fixture: Fixture) -> None:
    from service.errors import StorageError

    path = tmp_path / "shrinks.gguf"
    path.write_bytes(aligned_fixture.path.read_bytes())
    index = open_model(path)
    with open(path, "r+b") as f:
        f.truncate(index.files[0].data_offset + 10)
    with pytest.raises(StorageError, match="changed since its header was read .* bytes then"):
        await load_model(index, load_mode="none")
    assert fds_on(path) == 0 and load_threads() == 0


@pytest.mark.parametrize("mode", MODES)
async def test_a_file_replaced_after_parsing_is_refused(tmp_path: Path, mode: str) -> None:
    from service.errors import StorageError

    f32 = gguf.GGMLQuantizationType.F32
    path = write_fixture(tmp_path / "m.gguf", tensors={"w": (np.arange(64, dtype=np.float32), f32)}).path
    other = write_fixture(tmp_path / "o.gguf", tensors={"w": (np.ones(64, dtype=np.float32), f32)}).path
    index = open_model(path)
    other.replace(path)  # same size, other bytes: a download finishing, a cp over the file
    with pytest.raises(StorageError, match="changed since its header was read"):
        await load_model(index, load_mode=mode)
    assert fds_on(path) == 0 and mappings_of(path) == 0


async def test_file_shrinking_under_a_mapping_is_a_clear_error(tmp_path: Path) -> None:
    from service.errors import StorageError

    rng = np.random.default_rng(9)
    f32 = gguf.GGMLQuantizationType.F32
    tensors = {f"blk.{i}.w": (rng.standard_normal(1 << 16).astype(np.float32), f32) for i in range(4)}
    path = write_fixture(tmp_path / "shrinks.gguf", tensors=tensors).path
    index = open_model(path)
    with open(path, "r+b") as f:  # the file shrinks between parsing and mapping
        f.truncate(index.files[0].data_offset + 8192)
    with pytest.raises(StorageError, match="changed since its header was read"):
        await load_model(index, load_mode="mmap", chunk_nbytes=1 << 16)
    assert mappings_of(path) == 0


# -- onto emulated devices ------------------------------------------------------------------

DEVICE_SETUPS = {
    "cpu": ("", {}),
    "emu-all": ("EMU0=1GiB,EMU1=1GiB", {"n_gpu_layers": "all"}),
    "emu-partial": ("EMU0=1GiB", {"n_gpu_layers": 2}),
    "emu-host": ("EMU0=1GiB", {"n_gpu_layers": 1}),
}


def _load_on(path: Path, setup: str, mode: str, **extra: Any) -> tuple[LoadedModel, list[Any]]:
    from service.loader.devices import discover_devices
    from service.loader.placement import make_params

    spec, flags = DEVICE_SETUPS[setup]
    devs = discover_devices(spec, cuda=False)
    params = make_params([d.default_buffer_type.name for d in devs], load_mode=mode, **flags)
    return asyncio.run(load_model(open_model(path), devices=devs, params=params, **extra)), devs


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("setup", sorted(DEVICE_SETUPS))
def test_bytes_match_gguf_py_on_every_device_setup(all_types_fixture: Fixture, setup: str, mode: str) -> None:
    model, devs = _load_on(all_types_fixture.path, setup, mode)
    with model:
        assert_matches_reader(model, gguf.GGUFReader(all_types_fixture.path))
        placed = {t.name: t.device for t in model.plan.tensors if t.role == "weight"}
        assert {t.name: t.device for t in model} == placed
        if setup.startswith("emu"):
            assert any(t.device == "EMU0" for t in model)
    assert all(getattr(d, "allocated", 0) == 0 for d in devs)


@pytest.mark.sample
@pytest.mark.parametrize("mode", MODES)
def test_sample_on_two_emulated_devices(sample_name: str, sample_path: Path, sample_reader: Any, mode: str) -> None:
    # llama.cpp's buffers for -ngl 99 on two devices of equal memory; without mmap the
    # host part goes to the emulated device's host buffer type instead
    recorded = ORACLE[FACTS[sample_name].oracle_all_layers]["model_buffers"]
    expected = {b["buffer"]: b["MiB"] for b in recorded}
    if mode != "mmap":
        expected["EMU_Host"] = expected.pop("CPU_Mapped")
    model, devs = _load_on(sample_path, "emu-all", mode)
    with model:
        assert_matches_reader(model, sample_reader)
        assert model.tied_output is not None and model.tied_output.device == "EMU1"
        assert model.tied_output.data.tobytes() == model["token_embd.weight"].data.tobytes()
        assert {b.buffer_type: round(b.nbytes / (1 << 20), 2) for b in model.report.buffers} == expected
