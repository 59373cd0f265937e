"""Page-cache routing: which parts of a direct read are read buffered instead.

Under direct I/O, pages already in the page cache are read buffered (a copy from memory,
much faster than reading the disk again with ``O_DIRECT``), the rest with ``O_DIRECT``.
Short stretches are absorbed into their neighbours so that a scattered cache does not
split a read into many small ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from service.io.align import PAGE_SIZE, align_down, align_up

MIN_ROUTE_NBYTES = 1 << 20
"""Stretches of one kind (resident or not) shorter than this take their neighbour's route."""


@dataclass(frozen=True, slots=True)
class Segment:
    """A part ``[lo, hi)`` of a read (file offsets) and how it is read.

    Attributes:
        lo: start, aligned to the read's unit.
        hi: end, aligned to the read's unit (or the read's end).
        buffered: read through the page cache (else with ``O_DIRECT``).
    """

    lo: int
    hi: int
    buffered: bool


def route(
    pages: np.ndarray[tuple[int], np.dtype[np.bool_]],
    lo: int,
    hi: int,
    unit: int,
    min_run: int = MIN_ROUTE_NBYTES,
) -> list[Segment]:
    """Split the aligned read ``[lo, hi)`` into buffered and direct segments.

    Args:
        pages: residency of the pages from ``align_down(lo, PAGE_SIZE)`` on.
        lo: start of the read, a multiple of ``unit``.
        hi: end of the read, a multiple of ``unit``.
        unit: the direct-read block size (a power of two); a block is resident when
            every page of it is.
        min_run: stretches shorter than this take the route of the one before (the
            first, of the one after).

    Returns:
        Segments covering ``[lo, hi)`` in order, boundaries on ``unit``, alternating
        routes.
    """
    if hi <= lo:
        return []
    step = max(unit, PAGE_SIZE)
    k = step // PAGE_SIZE
    base = align_down(lo, step)
    head = (align_down(lo, PAGE_SIZE) - base) // PAGE_SIZE
    n_blocks = (align_up(hi, step) - base) // step
    padded = np.ones(n_blocks * k, dtype=bool)
    span = pages[: n_blocks * k - head]
    padded[head : head + len(span)] = span
    blocks: np.ndarray[Any, np.dtype[np.bool_]] = np.asarray(padded.reshape(n_blocks, k).all(axis=1))
    edges = np.flatnonzero(blocks[1:] != blocks[:-1]) + 1
    runs: list[list[int | bool]] = []
    prev = 0
    for e in [*edges.tolist(), n_blocks]:
        runs.append([max(base + prev * step, lo), min(base + e * step, hi), bool(blocks[prev])])
        prev = e
    out: list[list[int | bool]] = []
    for run in runs:
        if out and (int(run[1]) - int(run[0]) < min_run or out[-1][2] == run[2]):
            out[-1][1] = run[1]
        else:
            out.append(list(run))
    if len(out) > 1 and int(out[0][1]) - int(out[0][0]) < min_run:
        out[1][0] = out[0][0]
        out.pop(0)
    return [Segment(int(s), int(e), bool(f)) for s, e, f in out]
