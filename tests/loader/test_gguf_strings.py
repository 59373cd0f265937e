"""The vectorised scan of string arrays finds exactly the elements a walk one string at a
time finds, and the reader built on it reads what gguf-py reads and fails as the walk
fails (same error, message and byte offset)."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import gguf
import pytest
from gguf import GGUFValueType as V
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.errors import FormatError
from service.loader.gguf import read_gguf
from service.loader.gguf import reader as reader_module
from service.loader.gguf.strings import _pruned_chain, chain_in_block
from tests.helpers import gguf_kv, raw_gguf


def encode(strings: list[bytes], byte_order: str = "<") -> bytes:
    return b"".join(struct.pack(byte_order + "Q", len(s)) + s for s in strings)


def walk(block: bytes, byte_order: str) -> list[int]:
    """Offsets of the elements whose length prefix lies whole inside ``block``, walking
    one string at a time (the reference)."""
    offsets, pos = [], 0
    while pos + 8 <= len(block):
        offsets.append(pos)
        pos += 8 + struct.unpack_from(byte_order + "Q", block, pos)[0]
    return offsets


# strings that defeat the usual case: empty, starting with NUL, runs of zero bytes
_odd = st.sampled_from([b"", b"\0", b"\0\0\0\0abc", b"\0" * 9, b"a\0\0\0\0\0\0\0\0b", b"\x01"])
_strings = st.lists(st.one_of(st.binary(max_size=40), _odd, st.binary(min_size=200, max_size=600)), max_size=200)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(strings=_strings, cut=st.integers(0, 1 << 16), byte_order=st.sampled_from("<>"), extra=st.integers(0, 5))
def test_chain_matches_a_walk(strings: list[bytes], cut: int, byte_order: str, extra: int) -> None:
    data = encode(strings, byte_order)
    block = data[: min(cut, len(data))]
    expected = walk(block, byte_order)[: len(strings)]
    max_count = max(0, len(expected) - extra) if extra % 2 else len(strings)
    found, end = chain_in_block(block, max_count, byte_order)
    want = min(len(expected), max_count)
    assert found == want
    if want:
        last = expected[want - 1]
        assert end == last + 8 + struct.unpack_from(byte_order + "Q", block, last)[0]


@settings(max_examples=150, deadline=None)
@given(strings=_strings, byte_order=st.sampled_from("<>"))
def test_pruning_alone_finds_the_chain(strings: list[bytes], byte_order: str) -> None:
    """The exact method, which the usual case falls back on, without that usual case."""
    import numpy as np

    block = encode(strings, byte_order)
    m = len(block) - 7
    if m <= 0:
        return
    buf = np.frombuffer(block, dtype=np.uint8)
    high = 4 if byte_order == "<" else 0
    cand = np.flatnonzero(
        np.all([buf[high + k : high + k + m] == 0 for k in range(4)], axis=0)
    )  # every position whose four high bytes are zero
    expected = walk(block, byte_order)
    assert _pruned_chain(buf, cand, m, len(strings), byte_order == "<") == (
        len(expected),
        len(block) if expected else 0,
    )


def test_invalid_length_stops_the_chain_before_it() -> None:
    strings = [b"tok%d" % i for i in range(100)]
    data = bytearray(encode(strings))
    bad = walk(bytes(data), "<")[60]
    struct.pack_into("<Q", data, bad, (1 << 30) + 1)  # over GGUF_MAX_STRING_LENGTH
    found, end = chain_in_block(bytes(data), 100, "<")
    assert found <= 60
    if found:
        assert end == walk(bytes(data[:bad]), "<")[found - 1] + 8 + len(strings[found - 1])


def _vocab(n: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = rng.random()
        if k < 0.01:
            out.append(b"")
        elif k < 0.02:
            out.append(b"\0" + bytes(rng.randrange(256) for _ in range(rng.randrange(4))))
        elif k < 0.03:
            out.append(bytes(rng.randrange(256) for _ in range(rng.randrange(300, 3000))))
        else:
            out.append(f"▁tok{i}".encode())
    return out


@pytest.mark.parametrize("endianess", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_large_vocabulary_agrees_with_gguf_py(tmp_path: Path, endianess: gguf.GGUFEndian) -> None:
    tokens = _vocab(20_000, 1)
    merges = [f"a{i} b{i}" for i in range(9_000)]
    path = tmp_path / "vocab.gguf"
    w = gguf.GGUFWriter(path, "llama", endianess=endianess)
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.merges", merges)
    w.add_array("tokenizer.ggml.scores", [float(i) for i in range(len(tokens))])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    walked = []
    original = reader_module._Parser._walk_strings

    def counting(self: reader_module._Parser, key: str, count: int, pos: int, first: int) -> int:
        walked.append(count - first)
        return original(self, key, count, pos, first)

    reader_module._Parser._walk_strings = counting  # type: ignore[method-assign]
    try:
        ours = read_gguf(path)
    finally:
        reader_module._Parser._walk_strings = original  # type: ignore[method-assign]
    assert max(walked) < reader_module._VECTOR_MIN_STRINGS  # the long arrays were scanned
    theirs = gguf.GGUFReader(path)
    field = theirs.fields["tokenizer.ggml.tokens"]
    assert ours.kv["tokenizer.ggml.tokens"].value.string_bytes() == [bytes(field.parts[i]) for i in field.data]
    assert ours.kv["tokenizer.ggml.merges"].value.strings() == merges
    assert ours.kv["tokenizer.ggml.scores"].value.count == len(tokens)
    assert ours.byte_order == ("little" if endianess == gguf.GGUFEndian.LITTLE else "big")


def _error(path: Path) -> tuple[type, str, int | None]:
    with pytest.raises(FormatError) as info:
        read_gguf(path)
    return type(info.value), str(info.value), info.value.offset


@pytest.mark.parametrize("damage", ["truncate", "oversize", "past-end"])
def test_errors_in_long_arrays_are_those_of_the_walk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    strings = _vocab(12_000, 2)
    payload = bytearray(struct.pack("<IQ", V.STRING, len(strings)) + encode(strings))
    data = bytearray(raw_gguf([gguf_kv("tokenizer.ggml.tokens", V.ARRAY, bytes(payload))], []))
    at = 24 + 8 + len("tokenizer.ggml.tokens") + 4 + 12  # the first string's length prefix
    offsets = [at + o for o in walk(bytes(data[at:]), "<")]
    cases = []
    if damage == "truncate":
        cases = [bytes(data[:cut]) for cut in (offsets[5000] + 3, offsets[9000] + 9, len(data) - 1)]
    elif damage == "oversize":
        for i in (4500, 11_000):
            bad = bytearray(data)
            struct.pack_into("<Q", bad, offsets[i], 1 << 40)
            cases.append(bytes(bad))
    else:
        bad = bytearray(data)
        struct.pack_into("<Q", bad, offsets[-1], 1 << 20)  # the last string runs past the end
        cases.append(bytes(bad))
    for i, case in enumerate(cases):
        path = tmp_path / f"{damage}{i}.gguf"
        path.write_bytes(case)
        scanned = _error(path)
        with monkeypatch.context() as m:
            m.setattr(reader_module, "_VECTOR_MIN_STRINGS", 1 << 40)  # walk every string
            walked = _error(path)
        assert scanned == walked


def test_walked_vocabulary_agrees_with_gguf_py_and_the_scan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The walk a process without numpy takes (runs between cancel checks, reads as it
    goes) ends each array where gguf-py and the vectorised scan do."""
    tokens = _vocab(70_000, 3)
    path = tmp_path / "vocab.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.merges", [f"m{i} n{i}" for i in range(5_000)])
    w.add_uint32("general.after", 7)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    scanned = read_gguf(path)
    calls: list[int] = []
    monkeypatch.setattr(reader_module, "_scan_worth", lambda count: calls.append(count) or False)
    monkeypatch.setattr(reader_module, "_CHECK_STRINGS_MASK", 1023)  # many runs, reads between them
    monkeypatch.setattr(reader_module, "_FIRST_READ", 4096)
    walked = read_gguf(path)
    assert calls == [70_000, 5_000]
    theirs = gguf.GGUFReader(path)
    field = theirs.fields["tokenizer.ggml.tokens"]
    expected = [bytes(field.parts[i]) for i in field.data]
    for ours in (walked, scanned):
        assert ours.kv["tokenizer.ggml.tokens"].value.string_bytes() == expected
        assert ours.kv["general.after"].value == 7
    assert walked.kv["tokenizer.ggml.merges"].value.strings() == scanned.kv["tokenizer.ggml.merges"].value.strings()


def test_scan_only_where_numpy_is_loaded_or_worth_importing(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    assert "numpy" in sys.modules  # pytest's process has it: every long array is scanned
    assert reader_module._scan_worth(reader_module._VECTOR_MIN_STRINGS)
    monkeypatch.delitem(sys.modules, "numpy")
    assert not reader_module._scan_worth(262_144)
    assert reader_module._scan_worth(reader_module._IMPORT_WORTH_STRINGS)
