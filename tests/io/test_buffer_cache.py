"""The cache of freed host buffers: its byte cap, handing out a buffer once, accounting,
release when idle or short of memory, and loads into reused (dirty) buffers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from hypothesis import given, settings
from hypothesis import strategies as st

from service.api.admission import Reservations
from service.io import buffer_cache
from service.io.align import PAGE_SIZE, aligned_empty
from service.io.buffer_cache import HOST_BUFFER_CACHE, HostBufferCache, size_class
from service.io.meter import HOST_MEMORY, MemoryMeter
from service.loader.devices import base as devices_base
from service.loader.devices import discover_devices
from service.loader.devices.cpu import CPU_BUFFER_TYPE, CPUDevice
from service.loader.pipeline import LoadOptions, load_model
from service.loader.placement import make_params
from service.loader.weights import open_model
from tests.helpers import write_fixture

MiB = 1 << 20
PLENTY = (1 << 40, 1 << 40)


def _array(pages: int) -> np.ndarray:
    return aligned_empty(pages * PAGE_SIZE)


@given(st.lists(st.integers(1, 40), max_size=30), st.integers(0, 64))
@settings(max_examples=60, deadline=None)
def test_the_cache_never_holds_more_than_its_cap(sizes: list[int], cap_pages: int) -> None:
    meter = MemoryMeter()
    cache = HostBufferCache(cap_pages * PAGE_SIZE, memory=lambda: PLENTY, idle_s=0, meter=meter)
    kept: set[int] = set()
    for pages in sizes:
        array = _array(pages)
        if cache.put(array):
            kept.add(id(array))
        assert cache.nbytes <= cache.cap
        assert meter.nbytes == cache.nbytes  # every kept byte counted as held
    assert (cache.nbytes > 0) == bool(kept & {id(a) for a in cache._kept.values()})
    cache.configure(cap_pages * PAGE_SIZE // 2)
    assert cache.nbytes <= cache.cap and meter.nbytes == cache.nbytes
    assert cache.clear() >= 0 and cache.nbytes == 0 and meter.nbytes == 0


def test_take_hands_a_kept_buffer_out_once_and_only_of_its_size_class() -> None:
    cache = HostBufferCache(64 * PAGE_SIZE, memory=lambda: PLENTY, idle_s=0, meter=MemoryMeter())
    a = _array(4)
    assert cache.put(a)
    assert cache.take(5 * PAGE_SIZE) is None  # another class
    assert cache.take(4 * PAGE_SIZE - 100) is a  # same page-rounded class
    assert cache.take(4 * PAGE_SIZE) is None  # gone once taken
    assert not cache.put(aligned_empty(4 * PAGE_SIZE - 1))  # not a whole class


@pytest.fixture
def host_cache(monkeypatch: pytest.MonkeyPatch) -> Iterator[HostBufferCache]:
    """The process's cache switched on, for buffers from 1 MiB up."""
    monkeypatch.setattr(devices_base, "LARGE_BUFFER", 1 * MiB)
    monkeypatch.setattr(HOST_BUFFER_CACHE, "_memory", lambda: PLENTY)
    HOST_BUFFER_CACHE.configure(64 * MiB, idle_s=0)
    try:
        yield HOST_BUFFER_CACHE
    finally:
        HOST_BUFFER_CACHE.configure(0)


def _addr(buf: devices_base.HostBuffer) -> int:
    return int(buf.data.ctypes.data)


def test_a_freed_buffer_is_handed_out_again_and_a_buffer_in_use_never(host_cache: HostBufferCache) -> None:
    cpu = CPUDevice()
    held = HOST_MEMORY.nbytes
    a = cpu.alloc(CPU_BUFFER_TYPE, 3 * MiB + 5)
    assert isinstance(a, devices_base.HostBuffer) and not a.reused
    first = _addr(a)
    a.data[:] = 0xA5
    a.free()
    assert host_cache.nbytes == size_class(3 * MiB + 5)
    assert HOST_MEMORY.nbytes == held + host_cache.nbytes  # still the process's memory
    b = cpu.alloc(CPU_BUFFER_TYPE, 3 * MiB + 5)
    c = cpu.alloc(CPU_BUFFER_TYPE, 3 * MiB + 5)
    assert isinstance(b, devices_base.HostBuffer) and isinstance(c, devices_base.HostBuffer)
    assert b.reused and _addr(b) == first  # the freed one, its bytes as they were
    assert int(b.data[0]) == 0xA5
    assert not c.reused and _addr(c) != first
    assert host_cache.nbytes == 0
    # a buffer whose memory someone still views is not kept
    view = b.view(0, 16)
    b.free()
    assert host_cache.nbytes == 0
    d = cpu.alloc(CPU_BUFFER_TYPE, 3 * MiB + 5)
    assert _addr(d) != first and not d.reused
    view[:] = 1  # still its own memory
    assert int(d.data[0]) != 1 or _addr(d) != first
    for buf in (c, d):
        buf.free()
    host_cache.clear()
    assert HOST_MEMORY.nbytes == held


def test_kept_buffers_count_as_reclaimable_host_capacity(host_cache: HostBufferCache) -> None:
    cpu = CPUDevice()
    reservations = Reservations([cpu])
    buf = cpu.alloc(CPU_BUFFER_TYPE, 8 * MiB)
    buf.free()
    assert host_cache.nbytes == 8 * MiB
    capacity, free = reservations.capacities()["CPU"] or (0, 0)
    # capacity = free + held, and held includes the kept bytes: a load may count on them
    assert capacity >= free + host_cache.nbytes
    host_cache.clear()
    after, _ = reservations.capacities()["CPU"] or (0, 0)
    assert HOST_MEMORY.nbytes >= 0 and after <= capacity + 64 * MiB


def test_an_allocation_short_of_memory_gets_the_kept_bytes_back_first() -> None:
    free = [1 << 40]
    cache = HostBufferCache(64 * PAGE_SIZE, memory=lambda: (free[0], 1 << 40), idle_s=0, meter=MemoryMeter())
    assert cache.put(_array(8))
    assert cache.take(2 * PAGE_SIZE) is None and cache.nbytes == 8 * PAGE_SIZE  # plenty free: kept
    free[0] = PAGE_SIZE
    assert cache.take(2 * PAGE_SIZE) is None and cache.nbytes == 0  # short: dropped


def test_low_host_memory_empties_the_cache_and_keeps_nothing() -> None:
    mem = [(1 << 30, 1 << 30)]
    cache = HostBufferCache(64 * PAGE_SIZE, memory=lambda: mem[0], idle_s=0, meter=MemoryMeter())
    assert cache.put(_array(4))
    mem[0] = ((1 << 30) // buffer_cache.LOW_MEMORY_FRACTION - 1, 1 << 30)
    assert not cache.put(_array(4))
    assert cache.nbytes == 0


def test_an_idle_cache_is_emptied() -> None:
    meter = MemoryMeter()
    cache = HostBufferCache(64 * PAGE_SIZE, memory=lambda: PLENTY, idle_s=0.2, meter=meter)
    assert cache.put(_array(4))
    assert cache.release_if_idle() == 0  # just used
    deadline = time.monotonic() + 10
    while cache.nbytes and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cache.nbytes == 0 and meter.nbytes == 0  # the idle timer dropped it


def _models(tmp_path: Path) -> tuple[Path, Path]:
    """Two models of the same tensor shapes (the same buffer size), different bytes; the
    first one's F32 data is all NaN, tensor sizes not multiples of 32 (padding between)."""
    rng = np.random.default_rng(7)
    shapes = [(300, 1001), (7,), (513, 129), (1,), (2048, 257)]
    nan = {f"blk.{i}.w": (np.full(s, np.nan, dtype=np.float32), Q.F32) for i, s in enumerate(shapes)}
    good = {f"blk.{i}.w": (rng.standard_normal(s).astype(np.float32), Q.F32) for i, s in enumerate(shapes)}
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_fixture(a, tensors=nan)
    write_fixture(b, tensors=good)
    return a, b


@pytest.mark.parametrize("mode", ["none", "mlock", "direct-io"])
def test_a_load_into_a_reused_dirty_buffer_is_byte_identical(
    tmp_path: Path, host_cache: HostBufferCache, mode: str
) -> None:
    a, b = _models(tmp_path)
    devs = discover_devices("", cuda=False)
    params = make_params([d.default_buffer_type.name for d in devs], load_mode=mode)
    options = LoadOptions(check_tensors=True)
    with asyncio.run(load_model(open_model(a), devices=devs, params=params)) as first:
        assert len(first) == 5
    assert host_cache.nbytes > 0  # the first model's buffer is kept, NaN bytes in it
    hits = host_cache.hits
    with asyncio.run(load_model(open_model(b), devices=devs, params=params, options=options)) as second:
        assert host_cache.hits == hits + 1  # loaded into the first model's memory
        theirs = {t.name: t for t in gguf.GGUFReader(b).tensors}
        assert len(second) == len(theirs)
        for t in second:
            assert np.asarray(t.data).tobytes() == bytes(theirs[t.name].data.tobytes()), t.name
    # check-tensors found nothing: no stale NaN byte of the first model was read
