"""Which pages of a file are in the page cache (``mincore``).

A file range is probed through a temporary read-only mapping of it (no page is faulted
in by mapping or probing), or, for a file already mapped, through its mapping.

The kernel answers ``mincore`` truthfully for a file mapping only when the caller owns
the file, may write it, or holds ``CAP_FOWNER``; otherwise it reports every page
resident. :func:`trusted` tells which case a file is in; untrusted answers are not used.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap as _mmap_mod
import os
import platform

import numpy as np

from service.io import libc
from service.io.align import PAGE_SIZE, align_down, align_up

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_mincore = _libc.mincore
_mincore.restype = ctypes.c_int
_mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)

MAX_PROBE_NBYTES = 1 << 34
"""Largest range probed at once (16 GiB: a 4 MiB answer vector)."""

_CACHESTAT_NR = {"x86_64": 451, "aarch64": 451}.get(platform.machine())
"""``cachestat`` (Linux 6.5+): the system call number where it is known."""


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")
    ]


def cached_pages(fd: int, offset: int, nbytes: int) -> int | None:
    """How many pages of ``[offset, offset + nbytes)`` of the file open as ``fd`` are in
    the page cache (``cachestat``, Linux 6.5+: one pass over the cache's folios, several
    times cheaper than :func:`resident_pages` and no answer vector), or None where the
    kernel or the caller's rights do not allow it (ENOSYS, EPERM: recent kernels answer
    only where ``mincore`` would, see :func:`trusted`)."""
    if _CACHESTAT_NR is None or nbytes <= 0:
        return None
    rng = _CachestatRange(offset, nbytes)
    out = _Cachestat()
    if _libc.syscall(_CACHESTAT_NR, fd, ctypes.byref(rng), ctypes.byref(out), 0) != 0:
        return None
    return int(out.nr_cache)


def page_span(lo: int, hi: int) -> tuple[int, int]:
    """The pages covering the byte range ``[lo, hi)``: the byte offset of the first, and
    how many there are."""
    first = align_down(lo, PAGE_SIZE)
    return first, (align_up(hi, PAGE_SIZE) - first) // PAGE_SIZE


def cached_span(fd: int, lo: int, hi: int) -> tuple[int, int, int | None]:
    """The pages covering ``[lo, hi)`` of the file open as ``fd`` (:func:`page_span`),
    and how many of them are in the page cache (:func:`cached_pages`; None where the
    kernel does not tell)."""
    first, npages = page_span(lo, hi)
    return first, npages, cached_pages(fd, first, npages * PAGE_SIZE)


def trusted(fd: int) -> bool:
    """Whether ``mincore`` on a mapping of the file open as ``fd`` reports the page cache
    (the caller is root, owns the file or may write it)."""
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    euid = os.geteuid()
    if euid == 0 or st.st_uid == euid:
        return True
    try:
        return os.access(f"/proc/self/fd/{fd}", os.W_OK)
    except OSError:
        return False


def _probe(addr: int, nbytes: int) -> np.ndarray[tuple[int], np.dtype[np.bool_]]:
    pages = (nbytes + PAGE_SIZE - 1) // PAGE_SIZE
    vec = np.zeros(pages, dtype=np.uint8)
    if pages and _mincore(addr, nbytes, vec.ctypes.data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mincore: {os.strerror(err)}")
    return (vec & 1).astype(bool)


def resident_pages(fd: int, offset: int, nbytes: int) -> np.ndarray[tuple[int], np.dtype[np.bool_]]:
    """Residency of the pages covering ``[offset, offset + nbytes)`` of the file open as
    ``fd``: element ``i`` is the page at file offset ``align_down(offset, PAGE_SIZE) + i *
    PAGE_SIZE``.

    Raises:
        ValueError: ``nbytes`` is negative or above :data:`MAX_PROBE_NBYTES`.
        OSError: the range cannot be mapped or probed.
    """
    if not 0 <= nbytes <= MAX_PROBE_NBYTES:
        raise ValueError(f"cannot probe {nbytes} bytes (at most {MAX_PROBE_NBYTES})")
    start = align_down(offset, PAGE_SIZE)
    length = align_up(offset + nbytes, PAGE_SIZE) - start
    if length == 0:
        return np.zeros(0, dtype=bool)
    addr = libc.mmap(length, _mmap_mod.PROT_READ, _mmap_mod.MAP_SHARED, fd, start)
    try:
        return _probe(addr, length)
    finally:
        libc.munmap(addr, length)


def resident_in_mapping(addr: int, offset: int, nbytes: int) -> np.ndarray[tuple[int], np.dtype[np.bool_]]:
    """Residency of the pages covering ``[offset, offset + nbytes)`` of a file mapped at
    ``addr`` (page-aligned), indexed as :func:`resident_pages`.

    Raises:
        OSError: the range is not mapped.
    """
    start = align_down(offset, PAGE_SIZE)
    return _probe(addr + start, align_up(offset + nbytes, PAGE_SIZE) - start)


def resident_bytes(pages: np.ndarray[tuple[int], np.dtype[np.bool_]], offset: int, nbytes: int) -> int:
    """Bytes of ``[offset, offset + nbytes)`` in resident pages, ``pages`` as returned by
    :func:`resident_pages` for that range."""
    if nbytes <= 0 or not len(pages):
        return 0
    weights = np.full(len(pages), PAGE_SIZE, dtype=np.int64)
    weights[0] -= offset - align_down(offset, PAGE_SIZE)
    weights[-1] -= align_up(offset + nbytes, PAGE_SIZE) - (offset + nbytes)
    return int(weights[pages].sum())


class ResidencyMap:
    """Residency of a file's pages taken once, answering "how many bytes of ``[lo, hi)``
    were resident" in constant time (a prefix sum over the pages), for counting every
    extent of a load without a pass over its pages each time.

    Args:
        first: the file page (offset / page size) that ``pages[0]`` describes.
        pages: residency per page, as :func:`resident_pages` returns it.
    """

    def __init__(self, first: int, pages: np.ndarray[tuple[int], np.dtype[np.bool_]]) -> None:
        self.first = first
        self.pages = pages
        self.npages = len(pages)
        self.uniform: bool | None = None
        self._prefix = np.concatenate(([0], np.cumsum(pages, dtype=np.int64)))

    @classmethod
    def all_or_none(cls, first: int, npages: int, resident: bool) -> ResidencyMap:
        """A map of ``npages`` pages from page ``first`` that are all resident, or none
        (what :func:`cached_pages` tells without a per-page answer)."""
        out = cls.__new__(cls)
        out.first, out.npages, out.uniform = first, npages, resident
        return out

    @property
    def all_resident(self) -> bool:
        """Every page probed was resident."""
        if self.uniform is not None:
            return self.uniform
        return int(self._prefix[-1]) == self.npages

    def resident_bytes(self, lo: int, hi: int) -> int:
        """Bytes of ``[lo, hi)`` in pages that were resident; bytes outside the pages
        probed count as not resident."""
        lo = max(lo, self.first * PAGE_SIZE)
        hi = min(hi, (self.first + self.npages) * PAGE_SIZE)
        if hi <= lo:
            return 0
        if self.uniform is not None:
            return hi - lo if self.uniform else 0
        p0 = lo // PAGE_SIZE - self.first
        p1 = (hi - 1) // PAGE_SIZE - self.first
        total = int(self._prefix[p1 + 1] - self._prefix[p0]) * PAGE_SIZE
        if self.pages[p0]:
            total -= lo - (p0 + self.first) * PAGE_SIZE
        if self.pages[p1]:
            total -= (p1 + 1 + self.first) * PAGE_SIZE - hi
        return total
