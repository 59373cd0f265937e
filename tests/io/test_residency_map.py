"""The prefix-sum residency map against a byte-by-byte count."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.io.align import PAGE_SIZE
from service.io.residency import ResidencyMap, cached_pages, resident_pages


@given(
    st.integers(0, 5),
    st.lists(st.booleans(), min_size=1, max_size=12),
    st.integers(0, 20 * PAGE_SIZE),
    st.integers(0, 20 * PAGE_SIZE),
)
def test_resident_bytes_counts_each_byte_of_a_resident_page(first: int, flags: list[bool], a: int, b: int) -> None:
    pages = np.array(flags, dtype=bool)
    lo, hi = min(a, b), max(a, b)
    # byte by byte: a byte counts when its page was probed and resident
    per_byte = np.zeros(25 * PAGE_SIZE, dtype=bool)
    for i, resident in enumerate(flags):
        per_byte[(first + i) * PAGE_SIZE : (first + i + 1) * PAGE_SIZE] = resident
    assert ResidencyMap(first, pages).resident_bytes(lo, hi) == int(per_byte[lo:hi].sum())


@given(
    st.integers(0, 5), st.integers(1, 12), st.booleans(), st.integers(0, 20 * PAGE_SIZE), st.integers(0, 20 * PAGE_SIZE)
)
def test_all_or_none_map_counts_as_the_per_page_map(first: int, npages: int, resident: bool, a: int, b: int) -> None:
    lo, hi = min(a, b), max(a, b)
    per_page = ResidencyMap(first, np.full(npages, resident, dtype=bool))
    assert ResidencyMap.all_or_none(first, npages, resident).resident_bytes(lo, hi) == per_page.resident_bytes(lo, hi)


def _evict(fd: int) -> None:
    os.fdatasync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def test_cached_pages_agrees_with_mincore(tmp_path: Path) -> None:
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(64 * PAGE_SIZE + 100))
    fd = os.open(path, os.O_RDONLY)
    try:
        if cached_pages(fd, 0, PAGE_SIZE) is None:
            pytest.skip("cachestat is not available to this process")
        _evict(fd)
        first_half = os.pread(fd, 20 * PAGE_SIZE, 8 * PAGE_SIZE)  # read-ahead may bring more in
        assert len(first_half) == 20 * PAGE_SIZE
        for lo, n in [(0, 65 * PAGE_SIZE), (8 * PAGE_SIZE, 20 * PAGE_SIZE), (40 * PAGE_SIZE, 25 * PAGE_SIZE)]:
            assert cached_pages(fd, lo, n) == int(resident_pages(fd, lo, n).sum())
        os.pread(fd, 65 * PAGE_SIZE, 0)
        assert cached_pages(fd, 0, 65 * PAGE_SIZE) == 65
        _evict(fd)
        assert cached_pages(fd, 0, 65 * PAGE_SIZE) == int(resident_pages(fd, 0, 65 * PAGE_SIZE).sum())
    finally:
        os.close(fd)
