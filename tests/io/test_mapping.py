"""Mappings: fragments, page-aligned unmapping, closing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from service.errors import StorageError
from service.io.align import PAGE_SIZE
from service.io.mapping import Mapping, subtract_fragment
from tests.resources import mappings_of

P = PAGE_SIZE


@pytest.mark.parametrize(
    ("fragments", "first", "last", "expected"),
    [
        ([(0, 10 * P)], 2 * P, 4 * P, [(0, 2 * P), (4 * P, 10 * P)]),  # split
        ([(0, 10 * P)], 0, 4 * P, [(4 * P, 10 * P)]),  # head
        ([(0, 10 * P)], 6 * P, 10 * P, [(0, 6 * P)]),  # tail
        ([(2 * P, 4 * P)], 0, 10 * P, []),  # whole fragment
        ([(0, 2 * P), (6 * P, 8 * P)], 3 * P, 5 * P, [(0, 2 * P), (6 * P, 8 * P)]),  # between
        ([(0, 4 * P), (6 * P, 9 * P)], 3 * P, 7 * P, [(0, 3 * P), (7 * P, 9 * P)]),  # across two
    ],
)
def test_subtract_fragment(
    fragments: list[tuple[int, int]], first: int, last: int, expected: list[tuple[int, int]]
) -> None:
    assert subtract_fragment(fragments, first, last) == expected


@pytest.fixture
def data_file(tmp_path: Path) -> tuple[Path, bytes]:
    data = np.random.default_rng(0).integers(0, 256, 5 * P + 100, dtype=np.uint8).tobytes()
    path = tmp_path / "data.bin"
    path.write_bytes(data)
    return path, data


def test_unmap_fragment_aligns_inward(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    with Mapping(str(path)) as m:
        assert m.array(0, len(data)).tobytes() == data
        m.unmap_fragment(100, 3 * P + 5)  # pages 1 and 2 lie wholly inside
        assert m.fragments == [(0, P), (3 * P, 5 * P + 100)]
        assert m.array(0, P).tobytes() == data[:P]  # page 0 kept: bytes 0..99 still in use
        assert m.array(3 * P, 2 * P + 100).tobytes() == data[3 * P :]
        with pytest.raises(StorageError, match="no longer mapped"):
            m.array(P, 10)
        m.unmap_fragment(P // 2, P // 2 + 10)  # inside one page: nothing to unmap
        assert m.fragments == [(0, P), (3 * P, 5 * P + 100)]
        m.unmap_fragment(4 * P + 1, m.size)  # the tail: the page holding the end of the file goes
        assert m.fragments == [(0, P), (3 * P, 5 * P)]
        assert m.mapped_nbytes == 3 * P
        assert mappings_of(path) == 2
    assert m.closed and mappings_of(path) == 0


def test_unmapping_everything_then_closing(data_file: tuple[Path, bytes]) -> None:
    path, _ = data_file
    m = Mapping(str(path))
    m.unmap_fragment(0, m.size)
    assert m.fragments == [] and mappings_of(path) == 0
    m.close()
    m.close()


def test_out_of_range_views_are_refused(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    with Mapping(str(path)) as m:
        with pytest.raises(StorageError, match="outside the mapping"):
            m.array(len(data) - 4, 8)
        view = m.array(0, 16)
        assert not view.flags.writeable
