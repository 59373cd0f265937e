"""Host memory primitives: merged read-ahead ranges, the first-touch helper, the host
buffer policy, read-ahead advice."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.io import align, touch
from service.io.align import HUGE_PAGE_SIZE, PAGE_SIZE, aligned_empty, first_touch_policy
from service.io.readahead import merge_ranges, will_read
from service.io.touch import TouchAhead, host_array, prefault

ranges_st = st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 3_000)), max_size=40)


@given(ranges_st, st.integers(0, 500))
def test_merged_ranges_cover_the_input_bytes_and_no_more_than_short_gaps(
    ranges: list[tuple[int, int]], gap: int
) -> None:
    merged = merge_ranges(ranges, gap)
    wanted = np.zeros(13_001, dtype=bool)
    for off, n in ranges:
        wanted[off : off + n] = True
    covered = np.zeros(13_001 + gap, dtype=bool)
    for off, n in merged:
        assert n > 0 and not covered[off : off + n].any()  # disjoint
        covered[off : off + n] = True
    assert not (wanted & ~covered[: len(wanted)]).any()  # every input byte advised
    # what was added lies only in gaps of at most ``gap`` bytes between input bytes
    where = np.flatnonzero(wanted)
    for b in np.flatnonzero(covered[: len(wanted)] & ~wanted):
        lo, hi = where[where < b], where[where > b]
        assert len(lo) and len(hi) and hi[0] - lo[-1] - 1 <= gap
    for (a, n), (b, _) in zip(merged, merged[1:], strict=False):
        assert a + n + gap < b  # file order, more than ``gap`` apart


def _resident(array: np.ndarray) -> int:
    """Pages of ``array`` in memory (mincore)."""
    import ctypes

    mincore = ctypes.CDLL(None, use_errno=True).mincore
    mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    start = array.ctypes.data - array.ctypes.data % PAGE_SIZE
    pages = (array.ctypes.data + array.nbytes - start + PAGE_SIZE - 1) // PAGE_SIZE
    vec = np.zeros(pages, dtype=np.uint8)
    assert mincore(start, pages * PAGE_SIZE, vec.ctypes.data) == 0
    return int(np.count_nonzero(vec & 1))


FRESH = 40 << 20
"""Above glibc's largest mmap threshold (32 MiB): always fresh, untouched pages."""


def test_aligned_empty_leaves_pages_untouched_unless_asked() -> None:
    # in a fresh process: here malloc may hand out heap memory earlier tests touched
    code = (
        "from service.io.align import aligned_empty; from tests.io.test_memory import FRESH, _resident; "
        "a = aligned_empty(FRESH, huge=False); assert a.ctypes.data % 4096 == 0 and a.nbytes == FRESH; "
        "print(_resident(a))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) < 16
    populated = aligned_empty(FRESH, populate=True, huge=False)
    assert _resident(populated) == FRESH // PAGE_SIZE


def test_prefault_faults_in_the_whole_pages_of_a_view() -> None:
    import mmap

    # a fresh anonymous mapping: the allocator may hand out heap pages touched before
    region = mmap.mmap(-1, FRESH, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf = np.frombuffer(region, dtype=np.uint8)
        assert _resident(buf[: 3 * PAGE_SIZE]) == 0
        assert prefault(buf[PAGE_SIZE + 1 : 3 * PAGE_SIZE]) is True  # one whole page inside
        assert _resident(buf[PAGE_SIZE : 2 * PAGE_SIZE]) == 0  # the page the view starts inside
        assert _resident(buf[2 * PAGE_SIZE : 3 * PAGE_SIZE]) == 1
        del buf
    finally:
        region.close()


def _wait_for(cond: object) -> None:
    for _ in range(200):
        if cond():  # type: ignore[operator]
            return
        threading.Event().wait(0.02)


def test_touch_ahead_stays_within_its_lead_and_skips_what_the_writer_passed() -> None:
    import mmap

    # a fresh anonymous mapping: the allocator may hand out heap pages touched before
    region = mmap.mmap(-1, FRESH, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        _touch_ahead_within_lead(np.frombuffer(region, dtype=np.uint8))
    finally:
        region.close()


def _touch_ahead_within_lead(buf: np.ndarray) -> None:
    mib = 1 << 20
    with TouchAhead(buf, extent=mib, lead=4 * mib) as ahead:
        _wait_for(lambda: ahead.touched >= 4 * mib)
        threading.Event().wait(0.1)
        assert ahead.touched == 4 * mib  # the writer has not moved: no further than the lead
        ahead.advance(8 * mib)
        _wait_for(lambda: ahead.touched >= 8 * mib)
        threading.Event().wait(0.1)
        assert ahead.touched == 8 * mib
    pages = mib // PAGE_SIZE
    assert _resident(buf[: 4 * mib]) == 4 * pages
    assert _resident(buf[4 * mib : 8 * mib]) == 0  # the writer's part: left to it
    assert _resident(buf[8 * mib : 12 * mib]) == 4 * pages
    assert _resident(buf[12 * mib :]) == 0
    assert not [t for t in threading.enumerate() if t.name == "hoist-touch"]


def test_touch_ahead_close_stops_it_early_and_drops_the_buffer() -> None:
    buf = aligned_empty(64 << 20, huge=False)
    ahead = TouchAhead(buf, extent=PAGE_SIZE, lead=len(buf))
    ahead.close()
    assert ahead._array is None
    assert not [t for t in threading.enumerate() if t.name == "hoist-touch"]


def test_first_touch_falls_back_to_on_read_on_one_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(align, "FIRST_TOUCH", "background")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert first_touch_policy() == "on-read"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert first_touch_policy() == "background"
    monkeypatch.setattr(align, "FIRST_TOUCH", "populate")
    assert first_touch_policy() == "populate"


def _anon_huge_kib() -> int:
    text = Path("/proc/self/smaps_rollup").read_text()
    return int(re.search(r"AnonHugePages:\s+(\d+)", text).group(1))  # type: ignore[union-attr]


@pytest.mark.parametrize("policy", ["populate", "on-read", "background"])
def test_host_array_follows_the_policy(monkeypatch: pytest.MonkeyPatch, policy: str) -> None:
    monkeypatch.setattr(touch, "first_touch_policy", lambda: policy)
    small, helper = host_array(4096)
    assert helper is None and small.ctypes.data % 4096 == 0
    nbytes = align.LARGE_BUFFER + 12345
    monkeypatch.setattr(touch, "BACKGROUND_TOUCH_MIN", nbytes + 1)
    _, below = host_array(nbytes)  # under the helper's threshold: touched on read
    assert below is None
    monkeypatch.setattr(touch, "BACKGROUND_TOUCH_MIN", nbytes)
    big, helper = host_array(nbytes)
    assert big.nbytes == nbytes and big.ctypes.data % HUGE_PAGE_SIZE == 0
    assert (helper is not None) == (policy == "background")
    if helper is not None:
        helper._thread.join(timeout=30)
        helper.close()
    if policy != "on-read":  # (untouched memory is checked in a fresh process above)
        assert _resident(big) >= nbytes // PAGE_SIZE - 1
    big[:] = 7  # writable, whole
    assert int(big[-1]) == 7


def test_will_read_is_bounded_by_available_memory(tmp_path: Path) -> None:
    path = tmp_path / "data.bin"
    path.write_bytes(b"x" * (1 << 20))
    assert will_read(str(path), [(0, 1000), (1000, 1000), (5000, 10)]) == 5010  # 3000-byte gap merged
    assert will_read(str(path), [(0, 1000), (1000, 1000), (9000, 10)]) == 2010
    assert will_read(str(path), [(0, 1 << 20)], available=1 << 20) == 0  # more than half
    assert will_read(str(path), [(0, 0)]) == 0
    assert will_read(str(tmp_path / "missing"), [(0, 10)]) == 0


@pytest.mark.parametrize("on_fault", [True, False])
def test_a_lock_on_fault_leaves_pages_out_until_written_and_a_plain_lock_brings_them_in(on_fault: bool) -> None:
    import mmap

    from service.io.mlock import MemoryLock

    region = mmap.mmap(-1, FRESH, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        array = np.frombuffer(region, dtype=np.uint8)
        lock = MemoryLock(array.ctypes.data, "a test buffer", on_fault=on_fault)
        warning = lock.grow_to(FRESH)
        if warning is not None:
            pytest.skip(f"the lock limit refuses {FRESH} bytes here: {warning}")
        assert lock.locked == FRESH
        pages = FRESH // PAGE_SIZE
        assert _resident(array) == (0 if on_fault else pages)
        array[: FRESH // 2] = 7
        assert _resident(array) == (pages // 2 if on_fault else pages)
        lock.release()
        assert lock.locked == 0
        del array
    finally:
        region.close()


def test_a_prelock_covers_its_range_and_dropping_it_unlocks_the_pages_faulted_in_meanwhile() -> None:
    import mmap

    from service.io.mlock import MemoryLock
    from tests.resources import smaps_kib

    region = mmap.mmap(-1, FRESH, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        array = np.frombuffer(region, dtype=np.uint8)
        addr = array.ctypes.data
        lock = MemoryLock(addr, "a test buffer")
        if not lock.prelock(FRESH - 100):
            pytest.skip(f"the lock limit refuses {FRESH} bytes here")
        assert lock.covers(FRESH - 100) and lock.covers(1) and not lock.covers(FRESH + 1)
        array[: FRESH // 2] = 7  # faulted in, so locked
        assert smaps_kib(addr, addr + FRESH, "Locked") * 1024 == FRESH // 2
        lock.drop_prelock()
        assert smaps_kib(addr, addr + FRESH, "Locked") == 0 and not lock.covers(1)
        array[FRESH // 2 :] = 7  # no longer locked on fault
        assert smaps_kib(addr, addr + FRESH, "Locked") == 0
        assert lock.grow_to(PAGE_SIZE) is None  # locks step by step again
        assert smaps_kib(addr, addr + FRESH, "Locked") * 1024 == PAGE_SIZE
        lock.release()
        assert smaps_kib(addr, addr + FRESH, "Locked") == 0
        del array
    finally:
        region.close()
