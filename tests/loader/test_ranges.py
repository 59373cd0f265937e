"""Range arithmetic of mapped buffers: merge and subtract."""

from __future__ import annotations

import pytest

from service.loader.ranges import merge_ranges, subtract_ranges


@pytest.mark.parametrize(
    ("ranges", "slack", "expected"),
    [
        ([(10, 20), (0, 5)], 1, [(0, 5), (10, 20)]),
        ([(0, 10), (10, 20)], 1, [(0, 20)]),  # touching
        ([(0, 10), (5, 8)], 1, [(0, 10)]),  # contained
        ([(0, 10), (12, 20)], 1, [(0, 10), (12, 20)]),
        ([(0, 10), (12, 20)], 32, [(0, 20)]),  # padding after a tensor belongs to no one
        ([(0, 40), (64, 70)], 32, [(0, 70)]),  # 40..64 is the padding of the first
        ([(0, 40), (96, 100)], 32, [(0, 40), (96, 100)]),  # a whole aligned slot between: not padding
        ([], 1, []),
    ],
)
def test_merge(ranges: list[tuple[int, int]], slack: int, expected: list[tuple[int, int]]) -> None:
    assert merge_ranges(ranges, slack=slack) == expected


@pytest.mark.parametrize(
    ("own", "other", "expected"),
    [
        ([(0, 100)], [(20, 30)], [(0, 20), (30, 100)]),
        ([(0, 100)], [(0, 100)], []),
        ([(0, 100)], [(-5, 10), (90, 200)], [(10, 90)]),
        ([(0, 10), (20, 30)], [(5, 25)], [(0, 5), (25, 30)]),
        ([(0, 10)], [], [(0, 10)]),
        ([(0, 10), (50, 60)], [(10, 50)], [(0, 10), (50, 60)]),
    ],
)
def test_subtract(own: list[tuple[int, int]], other: list[tuple[int, int]], expected: list[tuple[int, int]]) -> None:
    assert subtract_ranges(own, other) == expected
