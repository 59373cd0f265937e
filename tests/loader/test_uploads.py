"""Staged uploads: the emulated device's stream and its stamped events, the upload
stage's timing (from the stamps, or by a thread for streams that do not stamp), and
which thread reads staged extents."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.loader.devices import EMUDevice, discover_devices
from service.loader.devices.emulated import EMUStream
from service.loader.pipeline import LoadOptions, load_model
from service.loader.pipeline.branches import Staged
from service.loader.pipeline.stats import StageClock
from service.loader.pipeline.upload import Uploader
from service.loader.placement import make_params
from service.loader.weights import open_model
from tests.loader.test_load_modes import assert_bytes_equal_file, leftovers, write_synthetic

CHUNK = 256 << 10


def _upload_all(device: EMUDevice, data: np.ndarray, clock: StageClock) -> tuple[Any, list[str], float]:
    """Upload ``data`` to a fresh buffer of ``device`` through 2 staging buffers of
    ``CHUNK`` bytes; returns the buffer, the names of the threads alive meanwhile, and
    the wall-clock seconds it took."""
    dest = device.alloc(device.default_buffer_type, len(data))
    started = time.perf_counter()
    up = Uploader(device, 2, CHUNK, 1, clock)
    try:
        threads = [t.name for t in threading.enumerate()]
        for pos in range(0, len(data), CHUNK):
            got = up.acquire(lambda: False)
            assert got is not None
            slot, buf, shift = got
            n = min(CHUNK, len(data) - pos)
            buf.write(shift, data[pos : pos + n])
            up.upload(slot, dest, pos, shift, n)
        up.drain()
    finally:
        up.close(abort=False)
    return dest, threads, time.perf_counter() - started


def test_emulated_stream_stamps_its_events_in_order() -> None:
    device = EMUDevice(0, 0)
    src = device.alloc(device.host_buffer_type, 4096)  # type: ignore[arg-type]
    dest = device.alloc(device.default_buffer_type, 4 * 4096)
    src.write(0, np.arange(4096, dtype=np.uint32).view(np.uint8)[:4096])
    stream = device.open_stream()
    assert stream is not None and stream.stamps_events
    before = time.perf_counter()
    events = [stream.upload(dest, i * 4096, src, 0, 4096) for i in range(4)]
    stream.close()
    stamps = [e.done_at for e in events]
    assert all(s is not None and before <= s <= time.perf_counter() for s in stamps)
    assert stamps == sorted(stamps)  # type: ignore[type-var]  # in order, as queued
    assert dest.read(0, 4 * 4096) == src.read(0, 4096) * 4
    src.free()
    dest.free()


@pytest.mark.parametrize("stamps", [True, False])
def test_the_upload_stage_is_timed_as_the_bus_allows(monkeypatch: pytest.MonkeyPatch, stamps: bool) -> None:
    # a 1 MiB upload over a 40 MB/s emulated bus takes 1 MiB / 40 MB/s of upload time,
    # timed from the stamped events or (a stream that does not stamp) by a thread
    monkeypatch.setattr(EMUStream, "stamps_events", stamps)
    bandwidth = 40_000_000
    device = EMUDevice(0, 0, bandwidth=bandwidth)
    data = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
    clock = StageClock()
    dest, threads, wall = _upload_all(device, data, clock)
    assert (f"hoist-{device.name}-uploads" in threads) is not stamps
    assert clock.nbytes == len(data)
    assert len(data) / bandwidth * 0.9 <= clock.seconds <= wall
    assert dest.read(0, len(data)) == data.tobytes()
    dest.free()
    assert device.allocated == 0
    assert not any(t.name.startswith(f"hoist-{device.name}") for t in threading.enumerate())


@pytest.mark.parametrize("mode", ["none", "direct-io"])
def test_staged_reads_run_on_the_loader_thread_unless_direct(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    # from the page cache a staged read is a copy that costs less than a hand-off to a
    # reader thread; direct reads wait on the disk and are kept in flight together
    path = write_synthetic(tmp_path / "m.gguf", 5)
    threads: list[str] = []
    read = Staged.read

    def spy(self: Staged, extent: Any, ticket: Any) -> None:
        threads.append(threading.current_thread().name)
        read(self, extent, ticket)

    monkeypatch.setattr(Staged, "read", spy)
    devs = discover_devices("EMU0=256MiB", cuda=False)
    params = make_params([d.default_buffer_type.name for d in devs], load_mode=mode, n_gpu_layers="all")
    options = LoadOptions(reads_in_flight=4, staging_nbytes=64 << 10)
    with asyncio.run(load_model(open_model(path), devices=devs, params=params, options=options)) as model:
        assert_bytes_equal_file(model, path)
        assert model.stats.branches.get("staged", 0) > 0
    assert len(threads) > 2
    if mode == "none":
        assert set(threads) == {"hoist-load"}
    else:
        assert all(name.startswith("hoist-read") for name in threads)
    assert leftovers(path, devs) == (0, 0, 0, 0)
