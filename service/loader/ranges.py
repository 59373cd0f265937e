"""Byte-range arithmetic over ``[start, end)`` pairs (llama.cpp's ``merge_ranges`` and
``sub_ranges``, used to decide which parts of a file mapping a buffer wraps)."""

from __future__ import annotations

from collections.abc import Iterable

Range = tuple[int, int]


def merge_ranges(ranges: Iterable[Range], *, slack: int = 1) -> list[Range]:
    """Sort ``ranges`` and merge those that overlap or touch.

    Args:
        ranges: ``[start, end)`` pairs, in any order.
        slack: a power of two; a range starting before ``align_up(previous end, slack)``
            merges with the previous one. With the file's data alignment this treats the
            padding after a tensor as part of it (1: only overlapping or touching ranges).

    Returns:
        Disjoint ranges in increasing order.
    """
    out: list[Range] = []
    for start, end in sorted(ranges):
        if out:
            prev_start, prev_end = out[-1]
            if start <= (prev_end + slack - 1) & ~(slack - 1):
                out[-1] = (prev_start, max(prev_end, end))
                continue
        out.append((start, end))
    return out


def subtract_ranges(own: list[Range], other: list[Range]) -> list[Range]:
    """``own`` minus ``other``; both disjoint and sorted (as :func:`merge_ranges` returns).

    Returns:
        The parts of ``own`` not covered by ``other``, disjoint and sorted; empty pieces
        are dropped.
    """
    out: list[Range] = []
    j = 0
    for start, end in own:
        cur = start
        while j < len(other) and other[j][1] <= cur:
            j += 1
        k = j
        while k < len(other) and other[k][0] < end:
            o_start, o_end = other[k]
            if o_start > cur:
                out.append((cur, o_start))
            cur = max(cur, o_end)
            if cur >= end:
                break
            k += 1
        if cur < end:
            out.append((cur, end))
    return out
