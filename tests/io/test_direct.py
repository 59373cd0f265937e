"""Direct I/O: aligned reads, head/tail trimming, fallback to buffered reads."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

from service.io import direct
from service.io.align import aligned_empty
from service.io.direct import DirectFile
from tests.helpers import refuse_o_direct


@pytest.fixture
def data_file(tmp_path: Path) -> tuple[Path, bytes]:
    data = np.random.default_rng(1).integers(0, 256, 3 * 4096 * 7 + 123, dtype=np.uint8).tobytes()
    path = tmp_path / "d.bin"
    path.write_bytes(data)
    return path, data


@pytest.mark.parametrize(("offset", "length"), [(0, 10), (33, 4096), (4095, 2), (5000, 30000), (12345, 50000)])
def test_unaligned_reads_through_a_bounce_buffer(data_file: tuple[Path, bytes], offset: int, length: int) -> None:
    path, data = data_file
    with DirectFile(str(path)) as f:
        dest = bytearray(length)
        f.read_into(memoryview(dest), offset, aligned_empty(3 * 4096))
        assert bytes(dest) == data[offset : offset + length]


def test_aligned_read_past_the_end_zero_fills(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    with DirectFile(str(path)) as f:
        a = max(f.alignment, 4096)
        buf = aligned_empty(2 * a)
        start = (len(data) // a) * a
        got = f.read_aligned(buf.data, start)
        assert got == len(data) - start
        assert buf[:got].tobytes() == data[start:] and not buf[got:].any()


def test_refused_open_falls_back(data_file: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    path, data = data_file
    refuse_o_direct(monkeypatch)
    with DirectFile(str(path)) as f:
        assert not f.direct and f.fallback is not None and "O_DIRECT refused" in f.fallback
        dest = bytearray(1000)
        f.read_into(memoryview(dest), 77, aligned_empty(8192))
        assert bytes(dest) == data[77:1077]


def test_refused_read_falls_back(data_file: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    path, data = data_file
    real = os.preadv
    calls = {"n": 0}

    def fail_first(fd: int, bufs: list[memoryview], offset: int) -> int:
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, bufs, offset)

    with DirectFile(str(path)) as f:
        if not f.direct:
            pytest.skip("this filesystem refuses O_DIRECT already")
        monkeypatch.setattr(direct.os, "preadv", fail_first)
        dest = bytearray(5000)
        f.read_into(memoryview(dest), 100, aligned_empty(4 * 4096))
        assert bytes(dest) == data[100:5100]
        assert not f.direct and f.fallback is not None and "direct read refused" in f.fallback
