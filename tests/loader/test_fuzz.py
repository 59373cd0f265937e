"""Property tests: mutated, truncated and spliced GGUF files either parse or raise hoist's
base error, within bounded memory and time."""

from __future__ import annotations

import asyncio
import struct
import tempfile
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.errors import HoistError
from service.loader.pipeline import load_model
from service.loader.weights import open_model
from tests.helpers import quantized_bytes, write_fixture

SETTINGS = settings(
    max_examples=150,
    deadline=2000,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)


def _seed_files() -> list[bytes]:
    rng = np.random.default_rng(11)
    with tempfile.TemporaryDirectory() as d:
        a = write_fixture(
            Path(d) / "a.gguf",
            kv=[
                ("t.str", "hello", V.STRING, None),
                ("t.arr", ["x", "yy", "zzz"], V.ARRAY, V.STRING),
                ("t.nums", [1, 2, 3, 4], V.ARRAY, V.INT32),
                ("t.f", 2.5, V.FLOAT32, None),
                ("t.b", True, V.BOOL, None),
            ],
            tensors={
                "token_embd.weight": (quantized_bytes(rng, Q.Q8_0, 2, 32), Q.Q8_0),
                "blk.0.w": (rng.standard_normal(4).astype(np.float32), Q.F32),
                "blk.1.w": (rng.standard_normal((2, 3)).astype(np.float16), Q.F16),
            },
        ).path.read_bytes()
        b = write_fixture(
            Path(d) / "b.gguf",
            kv=[("u.v", 7, V.UINT64, None)],
            tensors={"blk.2.q": (quantized_bytes(rng, Q.Q4_K, 1, 256), Q.Q4_K)},
            alignment=64,
        ).path.read_bytes()
    return [a, b]


SEEDS = _seed_files()
BIG = [0, 1, 5, 63, 64, 2**31 - 1, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1]


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as d:
        yield Path(d) / "fuzz.gguf"


def check(path: Path, data: bytes) -> None:
    """Parse (and, when it parses, load) ``data``: success or HoistError only, with the
    Python heap bounded by a multiple of the file size."""
    path.write_bytes(data)
    tracemalloc.start()
    try:
        try:
            index = open_model(path)
        except HoistError:
            return
        finally:
            _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= 1 << 20 or peak <= 64 * len(data) + (1 << 20), peak
    for mode in ("mmap", "none"):
        try:
            with asyncio.run(load_model(index, load_mode=mode)) as model:
                assert len(model) == len(index)
        except HoistError:
            pass


@SETTINGS
@given(seed=st.sampled_from(SEEDS), cut=st.integers(0, 10_000))
def test_truncation(scratch: Path, seed: bytes, cut: int) -> None:
    check(scratch, seed[: cut % (len(seed) + 1)])


@SETTINGS
@given(
    seed=st.sampled_from(SEEDS),
    edits=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=8),
)
def test_byte_mutations(scratch: Path, seed: bytes, edits: list[tuple[int, int]]) -> None:
    data = bytearray(seed)
    for pos, value in edits:
        data[pos % len(data)] = value
    check(scratch, bytes(data))


@SETTINGS
@given(
    seed=st.sampled_from(SEEDS),
    pos=st.integers(4, 10_000),
    value=st.sampled_from(BIG),
    width=st.sampled_from([4, 8]),
)
def test_huge_integers_anywhere(scratch: Path, seed: bytes, pos: int, value: int, width: int) -> None:
    data = bytearray(seed)
    pos = pos % (len(data) - width)
    struct.pack_into("<I" if width == 4 else "<Q", data, pos, value % (1 << (8 * width)))
    check(scratch, bytes(data))


@SETTINGS
@given(
    a=st.sampled_from(SEEDS),
    b=st.sampled_from(SEEDS),
    i=st.integers(0, 10_000),
    j=st.integers(0, 10_000),
    junk=st.binary(max_size=64),
)
def test_splices(scratch: Path, a: bytes, b: bytes, i: int, j: int, junk: bytes) -> None:
    check(scratch, a[: i % len(a)] + junk + b[j % len(b) :])
