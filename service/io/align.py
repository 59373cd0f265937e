"""Alignment arithmetic and aligned host buffers."""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np

from service.io import libc


def align_up(value: int, alignment: int) -> int:
    """``value`` rounded up to a multiple of ``alignment`` (a power of two)."""
    return (value + alignment - 1) & ~(alignment - 1)


def align_down(value: int, alignment: int) -> int:
    """``value`` rounded down to a multiple of ``alignment`` (a power of two)."""
    return value & ~(alignment - 1)


PAGE_SIZE = mmap.PAGESIZE
"""The host's page size in bytes."""


MADV_POPULATE_WRITE = 23
"""Linux 5.14+: fault in a range's pages for writing, in the kernel."""

_POPULATE_MIN = 1 << 20


def populate_write(array: np.ndarray[Any, Any]) -> None:
    """Fault in the pages of a large, about-to-be-written array at once (in the kernel,
    much cheaper than one fault per page as the data arrives). Best effort: nothing
    happens on kernels without ``MADV_POPULATE_WRITE`` or for small arrays."""
    if array.nbytes < _POPULATE_MIN:
        return
    start = align_up(array.ctypes.data, PAGE_SIZE)
    end = align_down(array.ctypes.data + array.nbytes, PAGE_SIZE)
    if end > start:
        try:
            libc.madvise(start, end - start, MADV_POPULATE_WRITE)
        except OSError:
            pass


def aligned_empty(nbytes: int, alignment: int = 4096) -> np.ndarray[tuple[int], np.dtype[np.uint8]]:
    """An uninitialised host buffer of ``nbytes`` bytes whose start address is a multiple
    of ``alignment`` (a power of two; 4096 suits O_DIRECT on every common filesystem),
    its pages faulted in when it is large.

    The array owns its memory (through its base); it is freed when the last view of it
    goes away.
    """
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    shift = (-raw.ctypes.data) % alignment
    out = raw[shift : shift + nbytes]
    populate_write(out)
    return out
