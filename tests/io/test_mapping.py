"""Mappings: fragments, page-aligned unmapping, closing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from service.errors import StorageError
from service.io.align import PAGE_SIZE
from service.io.mapping import Mapping, subtract_fragment
from tests.resources import mappings_of, smaps_kib

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


def _ahead_threads() -> int:
    import threading

    return sum(1 for t in threading.enumerate() if t.name == "hoist-populate")


def test_populate_ahead_faults_the_ranges_in_on_its_own_thread(tmp_path: Path) -> None:
    data = np.random.default_rng(1).integers(0, 256, 600 * P, dtype=np.uint8).tobytes()
    path = tmp_path / "big.bin"
    path.write_bytes(data)  # in the page cache: faulting in reads nothing
    with Mapping(str(path)) as m:
        assert smaps_kib(m.addr, m.addr + m.size) == 0
        m.populate_ahead([(10 * P, 200 * P), (300 * P, 100 * P)])
        m.populate(20 * P, 10 * P)  # inside the first range: waits for the thread
        assert _ahead_threads() == 0
        # both ranges are mapped in this process now (fault-around may map a few more)
        assert 300 * P // 1024 <= smaps_kib(m.addr, m.addr + m.size) < 600 * P // 1024
        assert m.array(10 * P, 200 * P).tobytes() == data[10 * P : 210 * P]


def test_populate_ahead_that_fails_leaves_the_error_to_the_load(tmp_path: Path, data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    with Mapping(str(path)) as m:
        m.populate_ahead([(0, len(data) + P)])  # past the end: the thread gives up quietly
        m.populate(0, P)  # faulted in by the call itself
        with pytest.raises(StorageError, match="outside the mapping"):
            m.populate(0, len(data) + P)
    assert _ahead_threads() == 0


def test_closing_a_mapping_stops_its_populate_ahead(tmp_path: Path) -> None:
    path = tmp_path / "big.bin"
    path.write_bytes(b"\1" * (64 << 20))
    for _ in range(5):
        m = Mapping(str(path))
        m.populate_ahead([(0, m.size)])
        m.close()  # at once: nothing may touch the mapping after it is gone
        assert _ahead_threads() == 0 and mappings_of(path) == 0
