"""The reader's tight loops (service/loader/gguf/batch.py) and its wide usual-case string
scans give exactly what the careful walk gives: the same parse, or the same error with
the same message and byte offset, on random and adversarial headers."""

from __future__ import annotations

import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gguf import GGUFValueType as V
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.errors import FormatError
from service.loader.ggml_types import GGML_TYPES, REMOVED_GGML_TYPES
from service.loader.gguf import GGUFArray, GGUFFloat, GGUFString, read_gguf
from service.loader.gguf import reader as reader_module
from service.loader.gguf.batch import skip_strings
from service.loader.gguf.constants import MAX_STRING_BYTES
from service.loader.gguf.strings import usual_chain
from tests.helpers import gguf_kv, gguf_string, gguf_tensor_info, raw_gguf

SETTINGS = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    database=None,
)


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as d:
        yield Path(d) / "batch.gguf"


def _value(v: Any) -> Any:
    if isinstance(v, GGUFArray):
        return ("array", v.element_type, v.count, v.payload, v.byte_order)
    if isinstance(v, GGUFFloat):
        return ("float", v.bits, v.width)
    if isinstance(v, GGUFString):
        return ("string", v.raw)
    return (type(v).__name__, v)


def outcome(path: Path) -> tuple[Any, ...]:
    """What parsing ``path`` gives, in a form that compares equal exactly when two parses
    agree: every field of the file, KV pair and tensor info, or the error's type,
    message, byte offset, key, tensor and hint."""
    try:
        f = read_gguf(path)
    except FormatError as exc:
        return ("error", type(exc), str(exc), exc.offset, exc.key, exc.tensor, exc.hint)
    return (
        "parsed",
        f.version,
        f.byte_order,
        f.alignment,
        f.data_offset,
        f.nbytes_read,
        [(k, e.type, e.offset, _value(e.value)) for k, e in f.kv.items()],
        [(t.name, t.ne, t.ggml_type, t.offset, t.nbytes, t.info_offset) for t in f.tensors],
        {name: f.tensor(name) for name in f._by_name},
    )


def both(path: Path, monkeypatch: pytest.MonkeyPatch, first_read: int, numpy_scan: bool = True) -> list[Any]:
    """``outcome(path)`` with the tight loops and wide scans, then with the careful walk
    only; reads start at ``first_read`` bytes (small: the loops meet the end of what was
    read often)."""
    results = []
    for fast in (True, False):
        with monkeypatch.context() as m:
            m.setattr(reader_module, "_BATCH", fast)
            m.setattr(reader_module, "_FIRST_READ", first_read)
            m.setattr(reader_module, "_scan_worth", lambda count: numpy_scan)
            results.append(outcome(path))
    return results


# -- tensor infos ------------------------------------------------------------------------

_types = sorted(GGML_TYPES)
_names = st.one_of(
    st.sampled_from(["blk.0.attn_q.weight", "token_embd.weight", "output.weight", "t", ""]),
    st.text(min_size=0, max_size=70).map(str.encode),  # UTF-8, perhaps with NUL, perhaps too long
    st.binary(min_size=0, max_size=66),  # perhaps not UTF-8
)
_dims = st.one_of(
    st.integers(1, 4096),
    st.sampled_from([0, -1, 32, 256, 1 << 31, 1 << 40, (1 << 62) + 1, (1 << 63) - 1]),
)
_type_ids = st.one_of(
    st.sampled_from(_types),
    st.sampled_from(sorted(REMOVED_GGML_TYPES) + [-1, len(_types) + 5, 1000]),
)


@st.composite
def tensor_tables(draw: st.DrawFn) -> tuple[bytes, int]:
    """A header with a few KV pairs and up to 40 tensor infos, mostly ordinary ones laid
    out as gguf.cpp expects, some of them damaged; and a cut point (or none)."""
    n = draw(st.integers(0, 40))
    names = draw(st.lists(_names, min_size=n, max_size=n))
    infos = []
    offset = 0
    for i, raw_name in enumerate(names):
        ordinary = draw(st.booleans()) or draw(st.booleans())
        name = f"blk.{i}.w".encode() if ordinary else raw_name
        type_id = draw(st.sampled_from(_types)) if ordinary else draw(_type_ids)
        block = GGML_TYPES[type_id].block_size if type_id in GGML_TYPES else 1
        n_dims = draw(st.integers(1, 4)) if ordinary else draw(st.sampled_from([0, 1, 2, 3, 4, 5, 1 << 31]))
        if ordinary:
            ne = [block * draw(st.integers(1, 64))] + [draw(st.integers(1, 9)) for _ in range(n_dims - 1)]
        else:
            ne = [draw(_dims) for _ in range(min(n_dims, 5))]
        info = bytearray(gguf_tensor_info(name, ne, type_id, offset))
        if n_dims != len(ne):
            struct.pack_into("<I", info, 8 + len(name), n_dims)
        if draw(st.booleans()) and ordinary:
            nbytes = GGML_TYPES[type_id].nbytes(tuple(ne))
            offset += -(-nbytes // 32) * 32
        infos.append(bytes(info))
    kvs = [gguf_kv("general.architecture", V.STRING, gguf_string("llama"))]
    data = raw_gguf(kvs, infos, b"\0" * 64)
    cut = draw(st.one_of(st.just(len(data)), st.integers(24, len(data))))
    return data, cut


@SETTINGS
@given(table=tensor_tables(), first_read=st.sampled_from([32, 100, 1 << 16]))
def test_tensor_infos_agree_with_the_careful_walk(
    scratch: Path, monkeypatch: pytest.MonkeyPatch, table: tuple[bytes, int], first_read: int
) -> None:
    data, cut = table
    scratch.write_bytes(data[:cut])
    fast, careful = both(scratch, monkeypatch, first_read)
    assert fast == careful


def test_the_tight_loop_reads_the_ordinary_tensor_infos(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sample-like table is read by the loop, not by the walk (else the comparisons
    above would compare the walk with itself)."""
    infos, offset = [], 0
    for i in range(300):
        ne = [256, 8 + i % 3]
        infos.append(gguf_tensor_info(f"blk.{i // 9}.t{i}", ne, 12, offset))  # Q4_K
        offset += -(-GGML_TYPES[12].nbytes(tuple(ne)) // 32) * 32
    path = tmp_path / "t.gguf"
    path.write_bytes(raw_gguf([], infos))
    walked: list[int] = []
    original = reader_module._Parser._tensor_info

    def counting(self: reader_module._Parser, index: int, seen: dict[str, Any]) -> Any:
        walked.append(index)
        return original(self, index, seen)

    monkeypatch.setattr(reader_module._Parser, "_tensor_info", counting)
    parsed = read_gguf(path)
    assert len(parsed.tensors) == 300 and not walked
    monkeypatch.setattr(reader_module, "_BATCH", False)
    assert read_gguf(path).tensors == parsed.tensors
    assert walked == list(range(300))


# -- string arrays -----------------------------------------------------------------------

_ordinary = st.binary(min_size=1, max_size=24).map(lambda b: b.replace(b"\0", b"x"))
_odd = st.sampled_from([b"", b"\0", b"\0\0\0\0abc", b"\0" * 9, b"a\0\0\0\0\0\0\0\0b"])
_strings = st.lists(st.one_of(_ordinary, _ordinary, _ordinary, _odd, st.binary(min_size=200, max_size=400)))


def encode(strings: list[bytes], byte_order: str = "<") -> bytes:
    return b"".join(struct.pack(byte_order + "Q", len(s)) + s for s in strings)


def offsets(data: bytes | bytearray, byte_order: str) -> list[int]:
    """Where each element of the chain from ``data``'s start begins, as far as its length
    prefix lies in ``data``; walking one element at a time (the reference)."""
    out, pos = [], 0
    while pos + 8 <= len(data):
        out.append(pos)
        pos += 8 + struct.unpack_from(byte_order + "Q", data, pos)[0]
    return out


@settings(max_examples=400, deadline=None, database=None)
@given(
    lengths=st.lists(
        st.one_of(
            st.integers(0, 40),
            st.sampled_from([MAX_STRING_BYTES, MAX_STRING_BYTES + 1, 1 << 40, 1 << 63, (1 << 64) - 1]),
        )
    ),
    cut=st.integers(0, 1 << 12),
    first=st.integers(0, 1 << 20),
    run=st.integers(0, 60),
    byte_order=st.sampled_from("<>"),
)
def test_skip_strings_stops_where_a_checked_walk_does(
    lengths: list[int], cut: int, first: int, run: int, byte_order: str
) -> None:
    """Strings ``first`` to ``first + run - 1`` start at byte 0 of a buffer cut at
    ``cut``: the loop skips a prefix of those the checked walk accepts, stopping at most
    one string early, and exactly at the first string whose length is invalid."""
    data = bytearray(b"".join(struct.pack(byte_order + "Q", n) + b"s" * min(n, 40) for n in lengths))[:cut]
    stop = first + run
    # the reference: string k at positions[k], checked one at a time
    positions = {first: 0}
    k, pos, bad = first, 0, False
    while k < stop and pos + 8 <= len(data):
        (length,) = struct.unpack_from(byte_order + "Q", data, pos)
        if length > MAX_STRING_BYTES:
            bad = True
            break
        pos += 8 + length
        k += 1
        positions[k] = pos
    i, at = skip_strings(data, 0, first, stop, byte_order)
    assert max(first, k - 1) <= i <= k
    assert at == positions[i]
    if bad:
        assert i == k


@settings(max_examples=300, deadline=None, database=None)
@given(strings=_strings, trailing=st.binary(max_size=300), byte_order=st.sampled_from("<>"), less=st.integers(0, 3))
def test_usual_chain_past_the_array(strings: list[bytes], trailing: bytes, byte_order: str, less: int) -> None:
    """The block runs past the array into whatever follows: the elements found are the
    array's first ones, and with ordinary strings all of them are found."""
    array = encode(strings, byte_order)
    max_count = max(0, len(strings) - less)
    found, end = usual_chain(array + trailing, max_count, byte_order)
    walk = offsets(array, byte_order) + [len(array)]
    assert 0 <= found <= max_count
    assert end == (walk[found] if found else 0)
    if all(s and b"\0" not in s for s in strings[:max_count]):
        assert found == max_count


def _string_file(strings: list[bytes], damage: int, tail: bool) -> bytes:
    payload = bytearray(struct.pack("<IQ", V.STRING, len(strings)) + encode(strings))
    at = [12 + o for o in offsets(bytes(payload[12:]), "<")]
    if damage and at:
        struct.pack_into("<Q", payload, at[damage % len(at)], [1 << 40, 1 << 20, MAX_STRING_BYTES + 1][damage % 3])
    kvs = [gguf_kv("tokenizer.ggml.tokens", V.ARRAY, bytes(payload))]
    if tail:
        kvs.append(gguf_kv("x.after", V.UINT32, struct.pack("<I", 7)))
    return raw_gguf(kvs, [gguf_tensor_info("t", [8], 0, 0)], b"\0" * 32)


@SETTINGS
@given(
    strings=st.lists(st.one_of(_ordinary, _ordinary, _ordinary, _ordinary, _odd), min_size=0, max_size=3000),
    damage=st.one_of(st.just(0), st.integers(1, 5000)),
    tail=st.booleans(),
    cut=st.one_of(st.none(), st.integers(24, 60_000)),
    first_read=st.sampled_from([64, 4096, 1 << 16]),
    numpy_scan=st.booleans(),
)
def test_string_arrays_agree_with_the_careful_walk(
    scratch: Path,
    monkeypatch: pytest.MonkeyPatch,
    strings: list[bytes],
    damage: int,
    tail: bool,
    cut: int | None,
    first_read: int,
    numpy_scan: bool,
) -> None:
    data = _string_file(strings, damage, tail)
    scratch.write_bytes(data[:cut])
    monkeypatch.setattr(reader_module, "_VECTOR_MIN_STRINGS", 64)  # scan arrays this short
    monkeypatch.setattr(reader_module, "_CHECK_STRINGS_MASK", 255)  # many runs
    fast, careful = both(scratch, monkeypatch, first_read, numpy_scan)
    assert fast == careful


@pytest.mark.parametrize("odd_every", [0, 97])
def test_large_vocabulary_scanned_wide_agrees_with_the_walk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, odd_every: int
) -> None:
    """A vocabulary of the samples' size (49,152 tokens, then merges): the wide scans
    settle it, the result is the walk's."""
    strings = [b"\0x" if odd_every and i % odd_every == 5 else f"\u0120tok{i}".encode() for i in range(49_152)]
    kvs = [
        gguf_kv("tokenizer.ggml.tokens", V.ARRAY, struct.pack("<IQ", V.STRING, len(strings)) + encode(strings)),
        gguf_kv(
            "tokenizer.ggml.token_type", V.ARRAY, struct.pack("<IQ", V.INT32, len(strings)) + b"\1\0\0\0" * len(strings)
        ),
        gguf_kv("tokenizer.ggml.merges", V.ARRAY, struct.pack("<IQ", V.STRING, 20_000) + encode([b"a b"] * 20_000)),
    ]
    path = tmp_path / "vocab.gguf"
    path.write_bytes(raw_gguf(kvs, [gguf_tensor_info("t", [8], 0, 0)], b"\0" * 32))
    fast, careful = both(path, monkeypatch, 1 << 16, numpy_scan=True)
    assert fast == careful
    assert fast[0] == "parsed"
