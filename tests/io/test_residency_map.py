"""The prefix-sum residency map against a byte-by-byte count."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from service.io.align import PAGE_SIZE
from service.io.residency import ResidencyMap


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
