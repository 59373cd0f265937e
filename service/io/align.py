"""Alignment arithmetic and aligned host buffers."""

from __future__ import annotations

import mmap

import numpy as np


def align_up(value: int, alignment: int) -> int:
    """``value`` rounded up to a multiple of ``alignment`` (a power of two)."""
    return (value + alignment - 1) & ~(alignment - 1)


def align_down(value: int, alignment: int) -> int:
    """``value`` rounded down to a multiple of ``alignment`` (a power of two)."""
    return value & ~(alignment - 1)


PAGE_SIZE = mmap.PAGESIZE
"""The host's page size in bytes."""


def aligned_empty(nbytes: int, alignment: int = 4096) -> np.ndarray[tuple[int], np.dtype[np.uint8]]:
    """An uninitialised host buffer of ``nbytes`` bytes whose start address is a multiple
    of ``alignment`` (a power of two; 4096 suits O_DIRECT on every common filesystem).

    The array owns its memory (through its base); it is freed when the last view of it
    goes away.
    """
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    shift = (-raw.ctypes.data) % alignment
    return raw[shift : shift + nbytes]
