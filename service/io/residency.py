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

import numpy as np

from service.io import libc
from service.io.align import PAGE_SIZE, align_down, align_up

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_mincore = _libc.mincore
_mincore.restype = ctypes.c_int
_mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)

MAX_PROBE_NBYTES = 1 << 34
"""Largest range probed at once (16 GiB: a 4 MiB answer vector)."""


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
        self._prefix = np.concatenate(([0], np.cumsum(pages, dtype=np.int64)))

    def resident_bytes(self, lo: int, hi: int) -> int:
        """Bytes of ``[lo, hi)`` in pages that were resident; bytes outside the pages
        probed count as not resident."""
        lo = max(lo, self.first * PAGE_SIZE)
        hi = min(hi, (self.first + len(self.pages)) * PAGE_SIZE)
        if hi <= lo:
            return 0
        p0 = lo // PAGE_SIZE - self.first
        p1 = (hi - 1) // PAGE_SIZE - self.first
        total = int(self._prefix[p1 + 1] - self._prefix[p0]) * PAGE_SIZE
        if self.pages[p0]:
            total -= lo - (p0 + self.first) * PAGE_SIZE
        if self.pages[p1]:
            total -= (p1 + 1 + self.first) * PAGE_SIZE - hi
        return total
