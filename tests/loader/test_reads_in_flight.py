"""Reads in flight and page-cache routing: every tensor byte-identical to gguf-py's reader
with 1, 2, 4 and 8 reads in flight, small and large chunks, onto the CPU and emulated
devices; the staging bound under a slow device; bytes from cache and from disk as the
page cache holds the file; the stage that bounded the load."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from service.errors import RequestError
from service.io import residency
from service.io.align import PAGE_SIZE
from service.loader.devices import discover_devices
from service.loader.model import LoadedModel
from service.loader.pipeline import LoadOptions, Progress, load_model
from service.loader.placement import make_params
from service.loader.weights import open_model
from tests.loader.test_load_modes import leftovers, write_model, write_synthetic
from tests.loader.test_pipeline import assert_matches_reader
from tests.resources import load_threads, smaps_kib

IN_FLIGHT = [1, 2, 4, 8]
SETUPS = {"cpu": ("", {}), "emu": ("EMU0=1GiB,EMU1=1GiB", {"n_gpu_layers": "all"})}
SMALL = {"chunk_nbytes": 4096, "direct_chunk_nbytes": 8192, "staging_nbytes": 4096}
LARGE: dict[str, int] = {}


def _load(path: Path, setup: str, mode: str, *, before: Any = None, **options: Any) -> tuple[LoadedModel, list[Any]]:
    """Load ``path``; ``before`` runs once its header is parsed."""
    spec, flags = SETUPS[setup]
    devs = discover_devices(spec, cuda=False)
    params = make_params([d.default_buffer_type.name for d in devs], load_mode=mode, **flags)  # type: ignore[arg-type]
    extra = {k: options.pop(k) for k in ("on_progress",) if k in options}
    index = open_model(path)
    if before is not None:
        before()
    model = asyncio.run(load_model(index, devices=devs, params=params, options=LoadOptions(**options), **extra))
    return model, devs


@pytest.fixture
def synthetic(tmp_path: Path) -> Path:
    return write_synthetic(tmp_path / "m.gguf", 12)


@pytest.mark.parametrize("n", IN_FLIGHT)
@pytest.mark.parametrize("chunks", ["small", "large"])
@pytest.mark.parametrize("mode", ["none", "direct-io", "mmap", "mlock"])
@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_bytes_match_gguf_py_with_reads_in_flight(synthetic: Path, setup: str, mode: str, chunks: str, n: int) -> None:
    seen: list[Progress] = []
    sizes = SMALL if chunks == "small" else LARGE
    model, devs = _load(synthetic, setup, mode, reads_in_flight=n, check_tensors=True, on_progress=seen.append, **sizes)
    with model:
        assert_matches_reader(model, gguf.GGUFReader(synthetic))
        assert model.stats.reads_in_flight == n
        done = [p.bytes_done for p in seen]
        assert done[-1] == seen[-1].bytes_total and all(b > a for a, b in zip(done, done[1:], strict=False))
        if chunks == "small":
            assert len(seen) > len(model.index)  # reported per chunk, inside tensors
        if setup == "emu" and mode != "mmap":
            assert model.stats.branches.get("staged") and all(p.in_flight == 0 for p in model.stats.pools.values())
    assert leftovers(synthetic, devs) == (0, 0, 0, 0)


@pytest.mark.sample
@pytest.mark.parametrize("n", IN_FLIGHT)
@pytest.mark.parametrize("chunks", ["small", "large"])
@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_sample_bytes_match_gguf_py_with_reads_in_flight(
    sample_path: Path, sample_reader: Any, setup: str, chunks: str, n: int
) -> None:
    # small chunks read buffered, large ones with direct I/O (routed by the page cache)
    mode, sizes = (
        ("none", {"chunk_nbytes": 1 << 20, "staging_nbytes": 1 << 20}) if chunks == "small" else ("direct-io", {})
    )
    model, devs = _load(sample_path, setup, mode, reads_in_flight=n, **sizes)
    with model:
        assert_matches_reader(model, sample_reader)
        stats = model.stats
        # every tensor byte loaded counted once (the tied output twice: it is loaded twice)
        assert stats.bytes_from_cache + stats.bytes_from_disk + stats.bytes_unprobed == sum(stats.branches.values())
    # (gguf-py's reader keeps its own mapping of the sample open: only the load's own count)
    assert load_threads() == 0 and all(getattr(d, "allocated", 0) == 0 for d in devs)


def test_reads_in_flight_are_bounded() -> None:
    for bad in (0, 17, -1):
        with pytest.raises(RequestError, match="reads_in_flight"):
            LoadOptions(reads_in_flight=bad)


@pytest.mark.parametrize("n", [1, 8])
def test_the_staging_bound_holds_under_a_slow_device(tmp_path: Path, n: int) -> None:
    rng = np.random.default_rng(2)
    path = write_model(tmp_path / "m.gguf", {"blk.0.w": (rng.standard_normal(1 << 19).astype(np.float32), Q.F32)})
    devs = discover_devices("EMU0=64MiB:bandwidth=40MB", cuda=False)
    params = make_params([d.default_buffer_type.name for d in devs], load_mode="none", n_gpu_layers="all")
    options = LoadOptions(staging_buffers=2, staging_nbytes=64 * 1024, reads_in_flight=n)
    with asyncio.run(load_model(open_model(path), devices=devs, params=params, options=options)) as model:
        pool = model.stats.pools["EMU0"]
        assert pool.buffers == 2 and pool.peak_in_flight <= 2  # eight reads in flight or not
        assert pool.waits > 10 and pool.wait_seconds > 0.02  # the reader waited for the slow device
        bound = model.stats.bound()
        assert bound is not None and bound["stage"] == "upload"  # 2 MiB at 40 MB/s: the bus bounds it
        assert bound["bytes_per_second"] < 45e6  # never faster than the bus
        assert_matches_reader(model, gguf.GGUFReader(path))


# -- page-cache routing ---------------------------------------------------------------------


def _evict(path: Path) -> None:
    """Drop the file's clean pages from the page cache; skip where that does not work."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if not residency.trusted(fd):
            pytest.skip("mincore does not report the page cache of this file")
        left = residency.resident_pages(fd, 0, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    if left.any():
        pytest.skip(f"the filesystem of {path.parent} keeps the file's pages (tmpfs?): eviction does not work")


def _warm(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(1 << 20):
            pass


@pytest.fixture
def big_model(tmp_path: Path) -> Path:
    rng = np.random.default_rng(3)
    tensors = {f"blk.{i}.w": (rng.standard_normal(1 << 20).astype(np.float32), Q.F32) for i in range(3)}  # 12 MiB
    return write_model(tmp_path / "big.gguf", tensors)


@pytest.mark.parametrize("mode", ["direct-io", "none", "mmap"])
@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_a_resident_file_comes_from_the_cache(big_model: Path, setup: str, mode: str) -> None:
    _evict(big_model)  # (skips where eviction, and so this distinction, does not work)
    model, _ = _load(big_model, setup, mode, before=lambda: _warm(big_model))
    with model:
        stats = model.stats.to_dict()
        assert stats["bytes_from_cache"] == model.index.nbytes and stats["bytes_from_disk"] == 0
        assert stats["bound"] is not None and stats["bound"]["stage"] in ("touch", "read", "upload", "validate")
        assert set(stats["stages"]) >= {"read"}
        assert_matches_reader(model, gguf.GGUFReader(big_model))


@pytest.mark.parametrize("mode", ["direct-io", "none", "mmap"])
@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_an_evicted_file_comes_from_disk(big_model: Path, setup: str, mode: str) -> None:
    model, _ = _load(big_model, setup, mode, before=lambda: _evict(big_model))
    with model:
        stats = model.stats
        # what the load's own reads and read-ahead bring in still counts as from disk
        assert stats.bytes_from_disk == model.index.nbytes and stats.bytes_from_cache == 0
        assert_matches_reader(model, gguf.GGUFReader(big_model))


def test_direct_io_reads_the_resident_part_buffered(big_model: Path) -> None:
    index = open_model(big_model)
    _evict(big_model)
    first = index["blk.0.w"]
    fd = os.open(big_model, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead past what is read
        os.pread(fd, first.nbytes, first.offset)  # the first tensor only
        resident = residency.resident_bytes(
            residency.resident_pages(fd, first.offset, first.nbytes), first.offset, first.nbytes
        )
    finally:
        os.close(fd)
    model, _ = _load(big_model, "cpu", "direct-io")
    with model:
        stats = model.stats
        assert resident > first.nbytes // 2
        assert 0 < stats.bytes_from_cache <= stats.bytes_from_cache + stats.bytes_from_disk == index.nbytes
        assert abs(stats.bytes_from_cache - resident) <= 2 << 20  # routing absorbs stretches under 1 MiB
        assert stats.bytes_from_disk >= 2 * first.nbytes - (2 << 20)  # the evicted tensors: O_DIRECT
        assert_matches_reader(model, gguf.GGUFReader(big_model))


# -- mapping ahead of the plan ---------------------------------------------------------------


def test_map_ahead_faults_in_the_files_wholly_in_the_page_cache(big_model: Path) -> None:
    from service.loader.pipeline.layout import Resources, map_ahead

    index = open_model(big_model)
    _evict(big_model)  # (skips where eviction does not work)
    res = Resources()
    map_ahead(index, res)
    assert res.mappings == {}  # nothing cached: left to the load, which reads it in order
    _warm(big_model)
    map_ahead(index, res)
    try:
        (mapping,) = res.mappings.values()
        first = index.files[0].data_offset
        mapping.populate(first, mapping.size - first)  # waits for the thread: nothing left to fault in
        assert smaps_kib(mapping.addr, mapping.addr + mapping.size + PAGE_SIZE - 1) * 1024 >= mapping.size - first
    finally:
        res.release()
    assert leftovers(big_model, []) == (0, 0, 0, 0)


def test_a_plan_that_fails_after_mapping_ahead_leaves_nothing(big_model: Path) -> None:
    from service.errors import PlacementError

    devs = discover_devices("EMU0=256MiB,EMU1=256MiB", cuda=False)
    params = make_params(
        [d.default_buffer_type.name for d in devs], load_mode="mmap", n_gpu_layers="all", tensor_split=[1, 1, 1]
    )
    _warm(big_model)
    with pytest.raises(PlacementError, match="tensor_split has 3 values but 2 devices"):
        asyncio.run(load_model(open_model(big_model), devices=devs, params=params))
    assert leftovers(big_model, devs) == (0, 0, 0, 0)


def test_a_file_rewritten_after_its_header_was_read_fails_a_mapped_load(big_model: Path) -> None:
    from service.errors import StorageError

    index = open_model(big_model)
    data = big_model.read_bytes()
    big_model.write_bytes(data[:-4096] + bytes(4096))  # same size, new contents: still in the page cache
    os.utime(big_model, ns=(1, 1))
    with pytest.raises(StorageError, match="changed since its header was read"):
        asyncio.run(load_model(index, load_mode="mmap"))
    assert leftovers(big_model, []) == (0, 0, 0, 0)


def _slow_populate_ahead(monkeypatch: pytest.MonkeyPatch, seconds: float) -> list[str]:
    """Make each step of a populate-ahead thread take ``seconds`` more (as a step of
    gigabytes does); returns the names of the threads that took a step."""
    from service.io import mapping as mapping_module

    populate = mapping_module.Mapping.populate
    steps: list[str] = []

    def slow(self: Any, offset: int, nbytes: int, *, ahead: bool = True) -> None:
        name = threading.current_thread().name
        if name == "hoist-populate":
            steps.append(name)
            time.sleep(seconds)
        populate(self, offset, nbytes, ahead=ahead)

    monkeypatch.setattr(mapping_module.Mapping, "populate", slow)
    return steps


async def _longest_stall(work: Any) -> tuple[float, BaseException | None]:
    """Await ``work`` while a ticker runs on the loop; the longest the loop went without
    running it, and what ``work`` raised."""
    longest, done = 0.0, False

    async def tick() -> None:
        nonlocal longest
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            longest, last = max(longest, now - last), now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.02)  # the ticker runs
    raised: BaseException | None = None
    try:
        await work
    except BaseException as exc:
        raised = exc
    done = True
    await ticker
    return longest, raised


@pytest.mark.parametrize("how", ["plan fails", "cancelled while planning"])
def test_a_load_that_ends_before_loading_stops_its_populate_ahead_off_the_event_loop(
    big_model: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    from service.errors import PlacementError
    from service.loader.pipeline import load as load_module

    steps = _slow_populate_ahead(monkeypatch, 0.8)
    devs = discover_devices("EMU0=256MiB,EMU1=256MiB", cuda=False)
    split = [1, 1, 1] if how == "plan fails" else [1, 1]
    params = make_params(
        [d.default_buffer_type.name for d in devs], load_mode="mmap", n_gpu_layers="all", tensor_split=split
    )
    plan_now = load_module._plan_now

    def slow_plan(*args: Any) -> Any:
        time.sleep(0.1)  # the populate-ahead thread is in its step
        return plan_now(*args)

    monkeypatch.setattr(load_module, "_plan_now", slow_plan)
    index = open_model(big_model)
    _warm(big_model)

    async def run() -> tuple[float, BaseException | None]:
        task = asyncio.ensure_future(load_model(index, devices=devs, params=params))
        if how == "cancelled while planning":
            asyncio.get_running_loop().call_later(0.05, task.cancel)
        return await _longest_stall(task)

    longest, raised = asyncio.run(run())
    if not steps:
        pytest.skip("the file was not seen wholly in the page cache: nothing was mapped ahead")
    assert isinstance(raised, PlacementError if how == "plan fails" else asyncio.CancelledError)
    # the populate step (0.8 s) is waited for on the loader thread, not on the loop
    assert longest < 0.4, f"the event loop stalled for {longest:.2f} s"
    assert leftovers(big_model, devs) == (0, 0, 0, 0)
