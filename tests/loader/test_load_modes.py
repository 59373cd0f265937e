"""Every load mode on every device kind; the staged branch (pool sizes, chunk sizes,
alignment, fallback, backpressure); lazy tensors; direct I/O fallback; mlock limits;
check-tensors; cancellation at many points leaving nothing behind."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import threading
import weakref
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from service.errors import InvalidDataError, LoadCancelledError
from service.loader.devices import EMUDevice, discover_devices
from service.loader.model import LoadedModel
from service.loader.pipeline import LoadOptions, Progress, load_model
from service.loader.pipeline.layout import order_jobs
from service.loader.placement import MemorySnapshot, make_params, plan
from service.loader.weights import open_model
from tests.helpers import finite_quant, refuse_o_direct, set_scale, write_fixture
from tests.resources import fds_on, load_threads, mappings_of, smaps_kib

MODES = ["none", "mmap", "mlock", "mmap+mlock", "direct-io"]
SETUPS = {
    "cpu": ("", {}),
    "emu": ("EMU0=256MiB,EMU1=256MiB", {"n_gpu_layers": "all"}),
    "emu-partial": ("EMU0=256MiB", {"n_gpu_layers": 2}),
    "emu-sync": ("EMU0=256MiB:sync", {"n_gpu_layers": "all"}),
}


def valid_tensors(seed: int = 0, *, big: bool = False) -> dict[str, tuple[np.ndarray, Q]]:
    """Tensors of several types with finite values and scales, in three layers; sizes that
    are not multiples of 32 bytes, of staging buffers or of each other."""
    rng = np.random.default_rng(seed)
    rows = 64 if big else 6
    return {
        "token_embd.weight": (finite_quant(rng, Q.Q8_0, rows, 64), Q.Q8_0),
        "output_norm.weight": (rng.standard_normal(7).astype(np.float32), Q.F32),
        "blk.0.attn_q.weight": (finite_quant(rng, Q.Q4_K, rows, 512), Q.Q4_K),
        "blk.0.ffn_up.weight": (rng.standard_normal((rows, 33)).astype(np.float16), Q.F16),
        "blk.1.attn_q.weight": (finite_quant(rng, Q.Q6_K, 3, 256), Q.Q6_K),
        "blk.1.ffn_up.weight": (finite_quant(rng, Q.Q5_0, rows, 96), Q.Q5_0),
        "blk.2.attn_norm.weight": (rng.standard_normal(1000).astype(np.float32), Q.F32),
    }


def write_synthetic(path: Path, seed: int) -> Path:
    """A small model with a tensor larger than every small chunk and than a direct chunk."""
    rng = np.random.default_rng(seed)
    tensors = valid_tensors(seed, big=True)
    tensors["blk.2.ffn_down.weight"] = (rng.standard_normal((96, 1000)).astype(np.float32), Q.F32)
    return write_model(path, tensors)


def write_model(path: Path, tensors: dict[str, tuple[np.ndarray, Q]]) -> Path:
    from gguf import GGUFValueType as V

    return write_fixture(path, kv=[("llama.block_count", 3, V.UINT32, None)], tensors=tensors).path


@pytest.fixture
def model_path(tmp_path: Path) -> Path:
    return write_model(tmp_path / "m.gguf", valid_tensors())


def load(path: Path, setup: str, mode: str, **options: Any) -> tuple[LoadedModel, list[Any]]:
    spec, flags = SETUPS[setup]
    devs = discover_devices(spec, cuda=False)
    params = make_params([d.default_buffer_type.name for d in devs], load_mode=mode, **flags)  # type: ignore[arg-type]
    extra = {k: options.pop(k) for k in ("on_progress",) if k in options}
    return asyncio.run(
        load_model(open_model(path), devices=devs, params=params, options=LoadOptions(**options), **extra)
    ), devs


def assert_bytes_equal_file(model: LoadedModel, path: Path) -> None:
    reader = gguf.GGUFReader(path)
    for ref in reader.tensors:
        t = model[ref.name]
        assert np.asarray(t.data).tobytes() == np.asarray(ref.data).tobytes(), (ref.name, t.buffer_type)
    if model.tied_output is not None:
        assert model.tied_output.data.tobytes() == model["token_embd.weight"].data.tobytes()


def leftovers(path: Path, devs: list[Any]) -> tuple[int, int, int, int]:
    emu = sum(d.allocated for d in devs if isinstance(d, EMUDevice))
    return (mappings_of(path), fds_on(path), load_threads(), emu)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_every_mode_on_every_device_kind(model_path: Path, setup: str, mode: str) -> None:
    model, devs = load(model_path, setup, mode, check_tensors=True)
    with model:
        assert_bytes_equal_file(model, model_path)
        branches = model.stats.branches
        if mode in ("mmap", "mmap+mlock"):
            assert branches.get("mapped", 0) > 0 and "read" not in branches and "staged" not in branches
        elif setup in ("emu", "emu-partial"):
            assert branches.get("staged", 0) > 0
        elif setup == "emu-sync":
            assert branches.get("sync", 0) > 0 and "staged" not in branches
        if mode == "direct-io" and setup != "cpu":
            assert model.stats.direct_io or model.warnings
    assert leftovers(model_path, devs) == (0, 0, 0, 0)


@pytest.mark.sample
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("setup", ["cpu", "emu"])
def test_sample_in_every_mode(sample_path: Path, sample_reader: Any, setup: str, mode: str) -> None:
    baseline = (mappings_of(sample_path), fds_on(sample_path))  # gguf-py's reader maps the file too
    model, devs = load(sample_path, setup, mode)
    with model:
        for ref in sample_reader.tensors:
            assert model[ref.name].data.tobytes() == np.asarray(ref.data).tobytes(), ref.name
    assert leftovers(sample_path, devs) == (*baseline, 0, 0)


# -- the staged branch ----------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("staging", [1000, 4097, 65536])
@pytest.mark.parametrize("mode", ["none", "direct-io"])
def test_staged_pools_and_chunk_sizes(tmp_path: Path, n: int, staging: int, mode: str) -> None:
    path = write_model(tmp_path / "m.gguf", valid_tensors(1, big=True))
    model, devs = load(path, "emu", mode, staging_buffers=n, staging_nbytes=staging, check_tensors=True)
    with model:
        assert_bytes_equal_file(model, path)
        pools = model.stats.pools
        assert pools and all(p.buffers == n and p.peak_in_flight <= n for p in pools.values())
        offsets = [model.index[name].offset for name in model.tensors]
        assert any(o % 4096 for o in offsets)  # tensors start off the direct I/O alignment
    assert leftovers(path, devs) == (0, 0, 0, 0)


def test_backpressure_bounds_the_buffers_in_flight(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    path = write_model(tmp_path / "m.gguf", {"blk.0.w": (rng.standard_normal(1 << 19).astype(np.float32), Q.F32)})
    devs = discover_devices("EMU0=64MiB:bandwidth=40MB", cuda=False)
    params = make_params([d.default_buffer_type.name for d in devs], load_mode="none", n_gpu_layers="all")
    options = LoadOptions(staging_buffers=2, staging_nbytes=64 * 1024)
    with asyncio.run(load_model(open_model(path), devices=devs, params=params, options=options)) as model:
        pool = model.stats.pools["EMU0"]
        assert pool.buffers == 2 and pool.peak_in_flight <= 2
        assert pool.waits > 10 and pool.wait_seconds > 0.02  # the reader waited for the slow device
        assert_bytes_equal_file(model, path)


@pytest.mark.parametrize("spec", ["EMU0=64MiB", "EMU0=64MiB:sync"])
def test_load_order_without_mmap(tmp_path: Path, spec: str) -> None:
    path = write_model(tmp_path / "m.gguf", valid_tensors(3))
    devs = discover_devices(spec, cuda=False)
    params = make_params(["CPU", "EMU0"], load_mode="none", n_gpu_layers=2, no_host=True)
    index = open_model(path)
    p = plan(index, devs, params, memory=MemorySnapshot.take(devs))
    from service.loader.pipeline.layout import Resources, build

    res = Resources()
    try:
        build(index, p, devs, res)
        jobs = order_jobs(res.jobs, p)
    finally:
        res.release()
    kinds = [j.branch for j in jobs]
    first_host = kinds.index("read")
    device = "sync" if spec.endswith(":sync") else "staged"
    assert set(kinds[:first_host]) == {device} and set(kinds[first_host:]) == {"read"}
    on_device = jobs[:first_host]
    if device == "sync":
        # each is read into a temporary buffer its size: the biggest while the fewest
        # weights are resident (llama.cpp's order)
        sizes = [j.nbytes for j in on_device]
        assert sizes == sorted(sizes, reverse=True)
    else:
        # through the fixed staging buffers: in file order, neighbours share extents
        offsets = [index.weights[j.name].offset for j in on_device]
        assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets)
        sizes = [j.nbytes for j in on_device]
        assert sizes != sorted(sizes, reverse=True)  # the fixture tells the two orders apart


def test_staged_tensors_go_in_file_order_across_the_chunks_of_a_buffer(tmp_path: Path) -> None:
    path = write_model(tmp_path / "m.gguf", valid_tensors(3, big=True))
    devs = discover_devices("EMU0=64MiB:max_alloc=20KiB", cuda=False)
    params = make_params(["CPU", "EMU0"], load_mode="none", n_gpu_layers="all")
    index = open_model(path)
    p = plan(index, devs, params, memory=MemorySnapshot.take(devs))
    (on_device,) = [b for b in p.buffers if b.buffer_type == "EMU0"]
    assert len(on_device.chunks) > 2  # the device's buffer is allocated in several pieces
    from service.loader.pipeline.layout import Resources, build

    res = Resources()
    try:
        build(index, p, devs, res)
        staged = [j for j in order_jobs(res.jobs, p) if j.branch == "staged"]
        # the pieces are filled in file order, and loaded in that order: each piece's
        # neighbours in the file follow each other through the staging buffers
        offsets = [index.weights[j.name].offset for j in staged]
        assert offsets == sorted(offsets) and len({id(j.dest) for j in staged}) > 2
    finally:
        res.release()
    model = asyncio.run(load_model(index, devices=devs, params=params))
    with model:
        assert_bytes_equal_file(model, path)
    assert leftovers(path, devs) == (0, 0, 0, 0)


# -- lazy tensors -------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["none", "mmap"])
def test_lazy_tensors(tmp_path: Path, mode: str) -> None:
    tensors = valid_tensors(4)
    rng = np.random.default_rng(4)
    tensors["per_layer_token_embd.weight"] = (rng.standard_normal((8, 64)).astype(np.float32), Q.F32)
    path = write_model(tmp_path / "m.gguf", tensors)
    devs = discover_devices("EMU0=64MiB", cuda=False)
    on = make_params(["CPU", "EMU0"], load_mode=mode, n_gpu_layers="all", lazy_mode="on", no_host=True)
    p = plan(open_model(path), devs, on, memory=MemorySnapshot.take(devs))
    lazy = [t for t in p.tensors if t.lazy]
    assert [t.name for t in lazy] == ["per_layer_token_embd.weight"] and lazy[0].device == "CPU"
    assert p.buffers[-1].lazy and p.buffers[-1].mapped and p.buffers[-1].name == "CPU_Mapped"
    with asyncio.run(load_model(open_model(path), devices=devs, params=on)) as model:
        t = model["per_layer_token_embd.weight"]
        assert t.lazy and t.buffer_type == "CPU_Mapped"
        assert model.stats.branches["lazy"] == t.nbytes  # not read during the load
        np.testing.assert_array_equal(t.data, tensors["per_layer_token_embd.weight"][0])  # read on demand
    auto = make_params(["CPU", "EMU0"], load_mode=mode, n_gpu_layers="all")
    assert not any(
        t.lazy for t in plan(open_model(path), devs, auto, memory=MemorySnapshot.take(devs)).tensors
    )  # below 4 GiB


# -- check-tensors ------------------------------------------------------------------------------


def bad_model(path: Path) -> Path:
    tensors = valid_tensors(5)
    f16, _ = tensors["blk.0.ffn_up.weight"]
    f16[2, 5] = np.nan
    q8, _ = tensors["token_embd.weight"]
    set_scale(q8, Q.Q8_0, 3, float("inf"))
    q4k, _ = tensors["blk.0.attn_q.weight"]
    set_scale(q4k, Q.Q4_K, 1, float("inf"), field=1)
    return write_model(path, tensors)


@pytest.mark.parametrize("mode", ["none", "mmap", "direct-io"])
@pytest.mark.parametrize("setup", ["cpu", "emu", "emu-sync"])
def test_check_tensors_reports_every_bad_tensor(tmp_path: Path, setup: str, mode: str) -> None:
    path = bad_model(tmp_path / "bad.gguf")
    with pytest.raises(InvalidDataError) as info:
        load(path, setup, mode, check_tensors=True)
    assert set(info.value.tensors) == {"blk.0.ffn_up.weight", "token_embd.weight", "blk.0.attn_q.weight"}
    assert "NaN" in info.value.tensors["blk.0.ffn_up.weight"]
    assert "Inf" in info.value.tensors["token_embd.weight"]
    assert "found 3 tensors with invalid data" in str(info.value)
    model, _ = load(path, setup, mode)  # without check-tensors the data loads as it is
    model.close()


def test_nan_case_with_check_tensors() -> None:
    path = Path(__file__).resolve().parent.parent / "data" / "cases" / "nan.gguf"
    with pytest.raises(InvalidDataError) as info:
        load(path, "cpu", "mmap", check_tensors=True)
    assert list(info.value.tensors) == ["t0"] and "NaN" in str(info.value)


# -- direct I/O fallback, mlock limits ----------------------------------------------------------


def test_direct_io_falls_back_where_refused(model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    refuse_o_direct(monkeypatch)
    model, devs = load(model_path, "emu", "direct-io")
    with model:
        assert_bytes_equal_file(model, model_path)
        assert any("direct I/O unavailable" in w and "O_DIRECT refused" in w for w in model.warnings)
        assert not model.stats.direct_io


@pytest.mark.parametrize("mode", ["mlock", "mmap+mlock"])
def test_a_low_memlock_limit_warns_and_the_load_goes_on(model_path: Path, mode: str) -> None:
    code = f"""
import asyncio, resource, sys
resource.setrlimit(resource.RLIMIT_MEMLOCK, (4096, resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]))
from service.loader.weights import open_model
from service.loader.pipeline import load_model
model = asyncio.run(load_model(open_model(sys.argv[1]), load_mode="{mode}"))
print(len(model.tensors))
print("\\n".join(model.warnings))
"""
    command = [sys.executable, "-c", code, str(model_path)]
    if os.geteuid() == 0:
        # root may lock without limit (CAP_IPC_LOCK): run without that capability
        if shutil.which("setpriv") is None:
            pytest.skip("running as root and setpriv is not available to drop CAP_IPC_LOCK")
        command = ["setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock", *command]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "7"
    warning = "\n".join(lines[1:])
    assert "failed to mlock" in warning and "RLIMIT_MEMLOCK is 4096 bytes" in warning and "are needed" in warning


@pytest.mark.parametrize("chunk_nbytes", [None, 100000])
def test_mmap_mlock_under_a_low_limit_locks_whole_tensors_as_far_as_it_allows(
    tmp_path: Path, chunk_nbytes: int | None
) -> None:
    # llama.cpp's lock grows after each tensor: under a 640 KiB limit the header page and
    # the first two 256 KiB tensors stay locked, the load warns, and nothing of the third
    # is locked, whether the file is one chunk (faulted in ahead) or chunks of 100000
    # bytes cut every tensor
    rng = np.random.default_rng(5)
    tensors = {f"blk.{i}.ffn_up.weight": (rng.standard_normal(64 * 1024).astype(np.float32), Q.F32) for i in range(3)}
    path = write_model(tmp_path / "m.gguf", tensors)
    code = """
import asyncio, resource, sys
resource.setrlimit(resource.RLIMIT_MEMLOCK, (640 << 10, resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]))
from service.loader.weights import open_model
from service.loader.pipeline import LoadOptions, load_model
from tests.resources import smaps_kib
options = LoadOptions(chunk_nbytes=None if sys.argv[2] == "None" else int(sys.argv[2]))
model = asyncio.run(load_model(open_model(sys.argv[1]), load_mode="mmap+mlock", options=options))
print(smaps_kib(0, 1 << 64, "Locked"))
print("\\n".join(model.warnings))
"""
    command = [sys.executable, "-c", code, str(path), str(chunk_nbytes)]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root and setpriv is not available to drop CAP_IPC_LOCK")
        command = ["setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock", *command]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[2])
    assert result.returncode == 0, result.stderr
    locked_kib, *warning = result.stdout.splitlines()
    ends = sorted(int(t.data_offset) + int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
    assert int(locked_kib) * 1024 == -(-ends[1] // 4096) * 4096  # the mapping starts on a page
    assert any("failed to mlock" in w for w in warning)


def test_a_mapped_load_of_a_cached_file_reports_one_chunk_per_run_of_tensors(tmp_path: Path) -> None:
    # 48 MiB in one run of adjacent tensors: three 16 MiB chunks when the chunk size is
    # given, one chunk when the pages are faulted in ahead and it is not
    tensors = {f"blk.{i}.ffn_up.weight": (np.full(4 << 20, i, dtype=np.float32), Q.F32) for i in range(3)}
    path = write_model(tmp_path / "m.gguf", tensors)
    path.read_bytes()  # in the page cache: its pages are faulted in ahead of the load
    seen: dict[str, list[int]] = {}
    for name, options in (("default", LoadOptions()), ("explicit", LoadOptions(chunk_nbytes=16 << 20))):
        done: list[int] = []
        model = asyncio.run(
            load_model(
                open_model(path),
                load_mode="mmap",
                options=options,
                on_progress=lambda p, d=done: d.append(p.bytes_done),
            )
        )
        with model:
            assert_bytes_equal_file(model, path)
        seen[name] = done
    total = 48 << 20
    assert seen["default"] == [0, total]
    assert seen["explicit"] == [0, 16 << 20, 32 << 20, total]


# -- cancellation -----------------------------------------------------------------------------


def _cancel_at(path: Path, setup: str, mode: str, when: int, **options: Any) -> tuple[Any, list[Any]]:
    calls = {"n": 0}

    def stop(_: Progress) -> bool:
        calls["n"] += 1
        return calls["n"] <= when

    spec, flags = SETUPS[setup]
    devs = discover_devices(spec, cuda=False)
    params = make_params([d.default_buffer_type.name for d in devs], load_mode=mode, **flags)  # type: ignore[arg-type]
    with pytest.raises(LoadCancelledError):
        asyncio.run(
            load_model(open_model(path), devices=devs, params=params, options=LoadOptions(**options), on_progress=stop)
        )
    return calls, devs


@pytest.mark.parametrize("when", [0, 1, 3, 10])
@pytest.mark.parametrize("mode", ["none", "mmap", "direct-io"])
@pytest.mark.parametrize("setup", ["cpu", "emu"])
def test_cancel_at_many_points(tmp_path: Path, setup: str, mode: str, when: int) -> None:
    path = write_model(tmp_path / "m.gguf", valid_tensors(6, big=True))
    _, devs = _cancel_at(
        path, setup, mode, when, chunk_nbytes=512, direct_chunk_nbytes=4096, staging_nbytes=1024, check_tensors=True
    )
    assert leftovers(path, devs) == (0, 0, 0, 0)


def test_cancel_the_task_during_slow_uploads_and_validation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from service.loader.pipeline import validation

    real = validation.validate_row_data
    validating = threading.Event()

    def slow_validate(ggml_type: str, data: Any) -> Any:
        validating.set()
        threading.Event().wait(0.05)
        return real(ggml_type, data)

    monkeypatch.setattr(validation, "validate_row_data", slow_validate)
    path = write_model(tmp_path / "m.gguf", valid_tensors(7, big=True))
    devs = discover_devices("EMU0=64MiB:bandwidth=2MB,EMU1=64MiB:bandwidth=2MB", cuda=False)
    params = make_params(["CPU", "EMU0", "EMU1"], load_mode="none", n_gpu_layers="all")
    options = LoadOptions(staging_nbytes=2048, check_tensors=True)

    async def scenario() -> None:
        task = asyncio.create_task(load_model(open_model(path), devices=devs, params=params, options=options))
        while not validating.is_set():
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert leftovers(path, devs) == (0, 0, 0, 0)


def load_shrinking_lazy_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int, **options: Any) -> None:
    """Load a model whose lazily read tensor's file shrinks once mapped, before the loader
    reads (let through the identity checks: the data side must still hold), with
    ``options``; expects the load to fail with "did the file shrink", not SIGBUS."""
    from service.errors import StorageError
    from service.loader.pipeline import layout, sources, worker

    tensors = valid_tensors(seed)
    rng = np.random.default_rng(seed)
    tensors["per_layer_token_embd.weight"] = (rng.standard_normal((64, 64)).astype(np.float32), Q.F32)
    path = write_model(tmp_path / "m.gguf", tensors)
    index = open_model(path)
    monkeypatch.setattr(layout, "check_identity", lambda *a: None)
    monkeypatch.setattr(sources, "check_identity", lambda *a: None)
    real_work = worker.Worker._work

    def shrink_then_work(self: worker.Worker) -> None:
        with open(path, "r+b") as f:
            f.truncate(index["per_layer_token_embd.weight"].offset + 10)
        real_work(self)

    monkeypatch.setattr(worker.Worker, "_work", shrink_then_work)
    params = make_params(["CPU"], load_mode="none", lazy_mode="on")
    with pytest.raises(StorageError, match="did the file shrink"):
        asyncio.run(load_model(index, params=params, options=LoadOptions(**options)))


def test_validation_of_mapped_data_never_faults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file that shrinks under a load with check-tensors gives an error, not SIGBUS."""
    load_shrinking_lazy_model(tmp_path, monkeypatch, 8, check_tensors=True)


def _watch_views(monkeypatch: pytest.MonkeyPatch) -> list[weakref.ref[Any]]:
    """Weak references to every typed tensor view the loads make from now on."""
    from service.loader.pipeline import load as load_module

    refs: list[weakref.ref[Any]] = []
    real = load_module._typed

    def typed(*args: Any) -> Any:
        view = real(*args)
        if isinstance(view, np.ndarray):
            refs.append(weakref.ref(view))
        return view

    monkeypatch.setattr(load_module, "_typed", typed)
    return refs


@pytest.mark.parametrize("mode", ["none", "mmap"])
def test_a_load_failing_check_tensors_keeps_no_view_of_its_buffers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    # the error is still held (as a caller logging or storing it does): the views of
    # device memory, host buffers and unmapped files it made must be gone already
    tensors = valid_tensors(12)
    tensors["blk.2.attn_norm.weight"] = (np.full(1000, np.nan, dtype=np.float32), Q.F32)
    path = write_model(tmp_path / "m.gguf", tensors)
    refs = _watch_views(monkeypatch)
    with pytest.raises(InvalidDataError) as caught:
        load(path, "emu-partial", mode, check_tensors=True)
    assert caught.value.tensors and refs
    assert [r for r in refs if r() is not None] == []


def test_a_load_cancelled_as_it_concludes_keeps_no_view_of_its_buffers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from service.loader.pipeline import load as load_module

    path = write_model(tmp_path / "m.gguf", valid_tensors(13))
    refs = _watch_views(monkeypatch)
    concluding, go_on = threading.Event(), threading.Event()
    real_finish = load_module._finish_load

    def finish(*args: Any) -> Any:
        out = real_finish(*args)
        concluding.set()
        go_on.wait(10)
        return out

    monkeypatch.setattr(load_module, "_finish_load", finish)
    devs = discover_devices(SETUPS["emu"][0], cuda=False)
    params = make_params(["CPU", "EMU0", "EMU1"], load_mode="none", n_gpu_layers="all")

    async def scenario() -> BaseException:
        task = asyncio.create_task(load_model(open_model(path), devices=devs, params=params))
        while not concluding.is_set():
            await asyncio.sleep(0.005)
        task.cancel()
        await asyncio.sleep(0.01)
        go_on.set()
        with pytest.raises(asyncio.CancelledError) as caught:
            await task
        return caught.value

    error = asyncio.run(scenario())  # held while the views are looked at
    assert error is not None and refs
    assert [r for r in refs if r() is not None] == []
    assert leftovers(path, devs) == (0, 0, 0, 0)


@pytest.mark.parametrize("mode", ["mmap", "mmap+mlock"])
def test_cancel_does_not_wait_for_the_pages_faulted_in_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    # a cached file's pages are faulted in ahead, 4 KiB a step here, each step 10 ms:
    # about 2 s for the whole file; a cancel stops it at the next step, and what was not
    # faulted in is neither checked nor locked
    import time

    from service.io import mapping
    from service.loader.pipeline.validation import Validators

    tensors = {f"blk.{i}.ffn_up.weight": (np.full(64 << 10, i, dtype=np.float32), Q.F32) for i in range(3)}
    path = write_model(tmp_path / "m.gguf", tensors)
    path.read_bytes()
    monkeypatch.setattr(mapping, "AHEAD_STEP", 4096)
    steps = {"n": 0}
    real = mapping.Mapping.populate

    def slow(self: mapping.Mapping, offset: int, nbytes: int, *, ahead: bool = True) -> None:
        if not ahead:  # a step of the thread faulting in ahead
            steps["n"] += 1
            time.sleep(0.01)
        real(self, offset, nbytes, ahead=ahead)

    monkeypatch.setattr(mapping.Mapping, "populate", slow)
    checked: list[str] = []
    real_file = Validators.file
    monkeypatch.setattr(Validators, "file", lambda self, job, fd: checked.append(job.name) or real_file(self, job, fd))
    options = LoadOptions(check_tensors=True)

    async def scenario() -> float:
        task = asyncio.create_task(load_model(open_model(path), load_mode=mode, options=options))
        while steps["n"] < 20:  # the loader is waiting for those pages by now
            await asyncio.sleep(0.005)
        task.cancel()
        started = time.perf_counter()
        with pytest.raises(asyncio.CancelledError):
            await task
        return time.perf_counter() - started

    assert asyncio.run(scenario()) < 1.0
    assert steps["n"] < 150  # of 193
    assert checked == []
    assert leftovers(path, []) == (0, 0, 0, 0)


def test_mmap_mlock_of_a_cached_file_builds_while_its_pages_are_faulted_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # faulting in the header's pages (to lock from the file's start) does not wait for
    # the thread faulting in the tensors' pages: the tensors are made meanwhile
    import time

    from service.io import mapping
    from service.loader.pipeline import load as load_module

    tensors = {f"blk.{i}.ffn_up.weight": (np.full(64 << 10, i, dtype=np.float32), Q.F32) for i in range(3)}
    path = write_model(tmp_path / "m.gguf", tensors)
    path.read_bytes()
    monkeypatch.setattr(mapping, "AHEAD_STEP", 4096)
    steps = {"n": 0, "at_build": -1}
    real_populate, real_typed = mapping.Mapping.populate, load_module._typed_tensors

    def slow(self: mapping.Mapping, offset: int, nbytes: int, *, ahead: bool = True) -> None:
        if not ahead:
            steps["n"] += 1
            time.sleep(0.002)
        real_populate(self, offset, nbytes, ahead=ahead)

    def typed(*args: Any) -> None:
        steps["at_build"] = steps["n"]
        real_typed(*args)

    monkeypatch.setattr(mapping.Mapping, "populate", slow)
    monkeypatch.setattr(load_module, "_typed_tensors", typed)
    with asyncio.run(load_model(open_model(path), load_mode="mmap+mlock")) as model:
        assert_bytes_equal_file(model, path)
    assert 0 <= steps["at_build"] < steps["n"] - 20  # of 193 steps


def test_a_cached_file_that_shrinks_names_the_first_tensor_cut_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the file shrinks into its third tensor while its pages are faulted in ahead: the run
    # of tensors is one chunk, yet the error names the third tensor and where its bytes
    # stop being readable, not the run's first tensor and start
    from service.errors import StorageError
    from service.io import mapping

    tensors = {f"blk.{i}.ffn_up.weight": (np.full(64 << 10, i, dtype=np.float32), Q.F32) for i in range(4)}
    path = write_model(tmp_path / "m.gguf", tensors)
    start = next(int(t.data_offset) for t in gguf.GGUFReader(path).tensors if t.name == "blk.2.ffn_up.weight")
    cut = start + 10000
    path.read_bytes()
    real = mapping.Mapping.populate

    def shrink_first(self: mapping.Mapping, offset: int, nbytes: int, *, ahead: bool = True) -> None:
        if os.path.getsize(path) > cut:
            os.truncate(path, cut)
        real(self, offset, nbytes, ahead=ahead)

    monkeypatch.setattr(mapping.Mapping, "populate", shrink_first)
    with pytest.raises(StorageError, match="did the file shrink") as caught:
        asyncio.run(load_model(open_model(path), load_mode="mmap"))
    assert caught.value.tensor == "blk.2.ffn_up.weight"
    assert caught.value.offset is not None and start <= caught.value.offset <= cut
    assert leftovers(path, []) == (0, 0, 0, 0)


def test_cancel_does_not_wait_for_a_slow_bus(tmp_path: Path) -> None:
    import time

    path = write_model(tmp_path / "m.gguf", valid_tensors(9, big=True))
    devs = discover_devices("EMU0=64MiB:bandwidth=20KB", cuda=False)
    params = make_params(["CPU", "EMU0"], load_mode="none", n_gpu_layers="all")
    options = LoadOptions(staging_nbytes=16384)
    started = time.perf_counter()
    with pytest.raises(LoadCancelledError):
        asyncio.run(
            load_model(
                open_model(path), devices=devs, params=params, options=options, on_progress=lambda p: p.bytes_done == 0
            )
        )
    assert time.perf_counter() - started < 5  # 4 queued 16 KiB copies would take over 3 s at 20 KB/s
    assert leftovers(path, devs) == (0, 0, 0, 0)


@pytest.mark.parametrize("n_gpu_layers", [None, 2])
def test_mmap_mlock_locks_the_file_up_to_its_last_host_tensor(tmp_path: Path, n_gpu_layers: int | None) -> None:
    # as llama.cpp's lock grown from the file's start: header, host tensors and (with
    # layers offloaded) the device tensors' pages in between
    path = write_model(tmp_path / "m.gguf", valid_tensors(4, big=True))
    devs = discover_devices("EMU0=1GiB" if n_gpu_layers else "", cuda=False)
    params = make_params(
        [d.default_buffer_type.name for d in devs], load_mode="mmap+mlock", n_gpu_layers=n_gpu_layers or 0
    )
    model = asyncio.run(load_model(open_model(path), devices=devs, params=params))
    with model:
        if any("failed to mlock" in w for w in model.warnings):
            pytest.skip("the lock limit is too low here")
        (mapping,) = model._mappings
        host = [t for t in model.plan.tensors if t.device == "CPU"]
        assert host and (n_gpu_layers is None or len(host) < len(model.plan.tensors))
        data_end = max(t.offset + t.nbytes for t in host)
        locked = smaps_kib(mapping.addr, mapping.addr + mapping.size + 4096, "Locked") * 1024
        assert data_end // 4096 * 4096 <= locked
        # and no further once loaded: the device tensors after the last host tensor are
        # not held locked (the file was cached, so it was locked on fault to its end
        # before the plan knew which tensors stay mapped; their pages are unmapped)
        assert locked <= -(-data_end // 4096) * 4096
        if n_gpu_layers:
            assert mapping.size > -(-data_end // 4096) * 4096  # the bound above bites
    assert smaps_kib(0, 1 << 64, "Locked") == 0  # released with the model


def test_mmap_mlock_locks_a_cached_file_on_fault_before_faulting_it_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # locking pages already faulted in walks them all and waits for a populate in
    # progress: a cached file is locked on fault first, in one call, and the plan's
    # lock is that one
    from service.io import mapping, mlock

    path = write_model(tmp_path / "m.gguf", valid_tensors(4, big=True))
    path.read_bytes()
    events: list[str] = []
    real_prelock, real_ahead = mlock.MemoryLock.prelock, mapping.Mapping.populate_ahead

    def prelock(self: mlock.MemoryLock, target: int) -> bool:
        events.append("lock on fault")
        return real_prelock(self, target)

    def ahead(self: mapping.Mapping, *args: Any) -> None:
        events.append("fault in ahead")
        real_ahead(self, *args)

    monkeypatch.setattr(mlock.MemoryLock, "prelock", prelock)
    monkeypatch.setattr(mapping.Mapping, "populate_ahead", ahead)
    model = asyncio.run(load_model(open_model(path), load_mode="mmap+mlock"))
    with model:
        if any("failed to mlock" in w for w in model.warnings):
            pytest.skip("the lock limit is too low here")
        assert events == ["lock on fault", "fault in ahead"]
        assert_bytes_equal_file(model, path)
        (mapped,) = model._mappings
        data_end = max(t.offset + t.nbytes for t in model.plan.tensors)
        assert smaps_kib(mapped.addr, mapped.addr + mapped.size + 4096, "Locked") * 1024 >= data_end // 4096 * 4096
    assert smaps_kib(0, 1 << 64, "Locked") == 0
