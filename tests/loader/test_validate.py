"""Row-data validation (llama.cpp's ggml_validate_row_data): every ggml type, NaN/Inf in
each checked value, sizes, inputs, quantized real data and speed."""

from __future__ import annotations

import mmap
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize, quantize

from service.loader import validate
from service.loader.ggml_types import GGML_TYPES, GGML_TYPES_BY_NAME
from service.loader.gguf import read_gguf
from service.loader.validate import InvalidData, validate_row_data
from tests.samples import FACTS

# What ggml checks, written out from ggml-quants.c / ggml-common.h independently of the
# module: for block types, each checked scale field as (name, byte offset in the block,
# storage) in the order ggml checks them.
F16, F32, E8M0, IQ1M = "f16", "f32", "e8m0", "iq1m"
BLOCK_SCALES: dict[str, list[tuple[str, int, str]]] = {
    "Q1_0": [("d", 0, F16)],
    "Q2_0": [("d", 0, F16)],
    "Q4_0": [("d", 0, F16)],
    "Q4_1": [("d", 0, F16), ("m", 2, F16)],
    "Q5_0": [("d", 0, F16)],
    "Q5_1": [("d", 0, F16), ("m", 2, F16)],
    "Q8_0": [("d", 0, F16)],
    "MXFP4": [("e", 0, E8M0)],
    "Q2_K": [("d", 80, F16), ("dmin", 82, F16)],
    "Q3_K": [("d", 108, F16)],
    "Q4_K": [("d", 0, F16), ("dmin", 2, F16)],
    "Q5_K": [("d", 0, F16), ("dmin", 2, F16)],
    "Q6_K": [("d", 208, F16)],
    "Q8_K": [("d", 0, F32)],
    "TQ1_0": [("d", 52, F16)],
    "TQ2_0": [("d", 64, F16)],
    "IQ1_S": [("d", 0, F16)],
    "IQ1_M": [("scales", 48, IQ1M)],
    "IQ2_XXS": [("d", 0, F16)],
    "IQ2_XS": [("d", 0, F16)],
    "IQ2_S": [("d", 0, F16)],
    "IQ3_XXS": [("d", 0, F16)],
    "IQ3_S": [("d", 0, F16)],
    "IQ4_XS": [("d", 0, F16)],
    "IQ4_NL": [("d", 0, F16)],
}
# Every element is checked for NaN and Inf (F64 after conversion to F32).
FLOAT_TYPES = {"F16": "<f2", "BF16": "<u2", "F32": "<f4", "F64": "<f8"}
# ggml has nothing to check: integers have no NaN, and NVFP4's one-byte UE4M3 scales
# decode every byte value to a finite number, so ggml accepts any NVFP4 data.
UNCHECKED_TYPES = {"I8", "I16", "I32", "I64", "NVFP4"}
# ggml's switch has no case for Q8_1 (an activation-only type): its data is rejected as an
# invalid type, however finite its scales are.
REJECTED_TYPES = {"Q8_1"}

F16_NAN_BITS = [0x7E00, 0x7C01, 0xFFFF, 0xFE00]
F16_INF_BITS = [0x7C00, 0xFC00]
F32_NAN_BITS = [0x7FC00000, 0x7F800001, 0xFFFFFFFF]
F32_INF_BITS = [0x7F800000, 0xFF800000]

N_BLOCKS = 40


def test_every_type_has_a_rule() -> None:
    names = {t.name for t in GGML_TYPES.values()}
    covered = set(BLOCK_SCALES) | set(FLOAT_TYPES) | UNCHECKED_TYPES | REJECTED_TYPES
    # every type a tensor may have has a rule, and every rule is for such a type
    assert names == covered, names ^ covered
    for name, fields in BLOCK_SCALES.items():
        if name in GGML_TYPES_BY_NAME:
            size = {F16: 2, F32: 4, E8M0: 1, IQ1M: 8}
            assert all(off + size[kind] <= GGML_TYPES_BY_NAME[name].type_size for _, off, kind in fields)


def test_module_table_matches_ggml() -> None:
    assert {
        name: [(s.name, s.offset, s.kind) for s in scales]
        for name, scales in validate._BLOCK_SCALES.items()
        if name in GGML_TYPES_BY_NAME
    } == {name: fields for name, fields in BLOCK_SCALES.items() if name in GGML_TYPES_BY_NAME}


def _pack_iq1m(words: np.ndarray, half: np.ndarray) -> None:
    """Put the 16-bit patterns ``half`` (shape (n,)) into the top nibbles of the IQ1_M
    scales words (shape (n, 4)), keeping their low 12 bits."""
    for k in range(4):
        nibble = (half.astype(np.uint16) >> (4 * k)) & 0xF
        words[:, k] = (words[:, k] & 0x0FFF) | (nibble << 12)


def _valid_blocks(name: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` blocks of random bytes whose checked scales are finite; shape (n, type_size)."""
    ts = GGML_TYPES_BY_NAME[name].type_size
    blocks = rng.integers(0, 256, (n, ts), dtype=np.uint8)
    for _, off, kind in BLOCK_SCALES.get(name, []):
        _set_scale(blocks, slice(None), off, kind, None, rng)
    return blocks


def _set_scale(
    blocks: np.ndarray, rows: slice | int, off: int, kind: str, bits: int | None, rng: np.random.Generator
) -> None:
    """Write a scale into ``blocks[rows]`` (blocks of shape (n, type_size)): the bit
    pattern ``bits`` (16 bits for f16 and iq1m, 32 for f32, the exponent byte for e8m0),
    or random finite values in [-2, 2] (exponents below 0xff) when ``bits`` is None."""
    view = blocks[rows].reshape(-1, blocks.shape[1])
    n = view.shape[0]
    if kind == E8M0:
        view[:, off] = rng.integers(0, 255, n) if bits is None else bits
        return
    if kind == F32:
        value = rng.uniform(-2, 2, n).astype("<f4") if bits is None else np.full(n, bits, "<u4")
        view[:, off : off + 4] = value.view(np.uint8).reshape(n, 4)
        return
    half = rng.uniform(-2, 2, n).astype("<f2").view("<u2") if bits is None else np.full(n, bits, "<u2")
    if kind == F16:
        view[:, off : off + 2] = half.view(np.uint8).reshape(n, 2)
    else:
        words = view[:, off : off + 8].copy().view("<u2")
        _pack_iq1m(words, half)
        view[:, off : off + 8] = words.view(np.uint8)


BLOCK_TYPES = sorted(name for name in BLOCK_SCALES if name in GGML_TYPES_BY_NAME)
CHECKED_FIELDS = [(name, field) for name in BLOCK_TYPES for field in BLOCK_SCALES[name]]


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_valid_random_blocks_pass(name: str) -> None:
    rng = np.random.default_rng(0)
    blocks = _valid_blocks(name, N_BLOCKS, rng)
    assert validate_row_data(name, blocks) is None
    assert validate_row_data(name, blocks.tobytes()) is None


def _bad_patterns(kind: str) -> list[tuple[str, int]]:
    if kind == E8M0:
        return [("0xff", 0xFF)]
    if kind == F32:
        return [("NaN", b) for b in F32_NAN_BITS] + [("Inf", b) for b in F32_INF_BITS]
    return [("NaN", b) for b in F16_NAN_BITS] + [("Inf", b) for b in F16_INF_BITS]


@pytest.mark.parametrize(("name", "field"), CHECKED_FIELDS, ids=[f"{n}-{f[0]}" for n, f in CHECKED_FIELDS])
def test_bad_scale_is_reported_at_its_block(name: str, field: tuple[str, int, str]) -> None:
    field_name, off, kind = field
    ts = GGML_TYPES_BY_NAME[name].type_size
    rng = np.random.default_rng(1)
    for word, bits in _bad_patterns(kind):
        blocks = _valid_blocks(name, N_BLOCKS, rng)
        _set_scale(blocks, 17, off, kind, bits, rng)
        _set_scale(blocks, 30, off, kind, bits, rng)  # a later bad block is not the one reported
        data = blocks.reshape(-1)
        data.flags.writeable = False
        got = validate_row_data(name, data)
        assert got is not None and got.offset == 17 * ts + off, (word, hex(bits), got)
        assert word in got.reason
        assert f"block scale {field_name} of block 17" in got.reason


@pytest.mark.parametrize("name", [n for n in BLOCK_TYPES if len(BLOCK_SCALES[n]) == 2])
def test_first_field_of_a_block_is_reported_first(name: str) -> None:
    (first, off1, kind), (second, off2, _) = BLOCK_SCALES[name]
    rng = np.random.default_rng(2)
    ts = GGML_TYPES_BY_NAME[name].type_size
    blocks = _valid_blocks(name, N_BLOCKS, rng)
    _set_scale(blocks, 5, off2, kind, 0x7C00, rng)
    got = validate_row_data(name, blocks)
    assert got is not None and got.offset == 5 * ts + off2 and f"scale {second} of block 5" in got.reason
    _set_scale(blocks, 5, off1, kind, 0x7E00, rng)
    got = validate_row_data(name, blocks)
    assert (
        got is not None and got.offset == 5 * ts + off1 and f"NaN in the block scale {first} of block 5" in got.reason
    )
    _set_scale(blocks, 3, off2, kind, 0x7E00, rng)  # an earlier block wins whatever its field
    got = validate_row_data(name, blocks)
    assert got is not None and got.offset == 3 * ts + off2


def test_mxfp4_every_exponent_but_0xff_is_valid() -> None:
    blocks = np.zeros((256, 17), dtype=np.uint8)
    blocks[:, 0] = np.arange(256)
    assert validate_row_data("MXFP4", blocks[:255]) is None
    assert validate_row_data("MXFP4", blocks) == InvalidData(
        "reserved E8M0 value 0xff (NaN) in the block scale e of block 255", 255 * 17
    )


def test_iq1m_checks_only_the_packed_half() -> None:
    rng = np.random.default_rng(3)
    blocks = _valid_blocks("IQ1_M", 8, rng)
    words = blocks[:, 48:56].copy().view("<u2")
    # the low 12 bits of each scales word are 3-bit sub-block scales: any value is valid
    words |= 0x0FFF
    blocks[:, 48:56] = words.view(np.uint8)
    assert validate_row_data("IQ1_M", blocks) is None
    # the packed half is nibble k = top nibble of word k: 0x7C00 (Inf), then 0x7C01 (NaN)
    words[4] = [0x0FFF, 0x0FFF, 0xCFFF, 0x7FFF]
    blocks[:, 48:56] = words.view(np.uint8)
    assert validate_row_data("IQ1_M", blocks) == InvalidData(
        "Inf in the block scale scales of block 4 (the half packed in its top nibbles)", 4 * 56 + 48
    )
    words[4, 0] = 0x1FFF
    blocks[:, 48:56] = words.view(np.uint8)
    got = validate_row_data("IQ1_M", blocks)
    assert got is not None and got.reason.startswith("NaN in the block scale scales of block 4")


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_bad_scale_matches_gguf_dequantize(name: str) -> None:
    """gguf-py's own block layouts agree: a NaN where the check looks makes that block's
    dequantized values non-finite, and small finite scales keep them finite."""
    if name not in gguf.GGMLQuantizationType.__members__:
        pytest.skip(f"gguf has no {name}")
    qtype = gguf.GGMLQuantizationType[name]
    rng = np.random.default_rng(4)
    blocks = _valid_blocks(name, 4, rng)
    try:
        with np.errstate(over="ignore", invalid="ignore"):
            clean = dequantize(blocks, qtype)
    except NotImplementedError:
        pytest.skip(f"gguf cannot dequantize {name}")
    if name != "MXFP4":  # a large finite E8M0 exponent overflows F32 when dequantized
        assert np.isfinite(clean).all()
    for _, off, kind in BLOCK_SCALES[name]:
        bad = blocks.copy()
        _set_scale(bad, 2, off, kind, 0xFF if kind == E8M0 else 0x7E00, rng)
        with np.errstate(over="ignore", invalid="ignore"):
            values = dequantize(bad, qtype).reshape(4, -1)
        assert not np.isfinite(values[2]).all(), off
        np.testing.assert_array_equal(values[[0, 1, 3]], clean.reshape(4, -1)[[0, 1, 3]])


@pytest.mark.parametrize("name", sorted(FLOAT_TYPES))
def test_finite_floats_pass(name: str) -> None:
    rng = np.random.default_rng(5)
    values = rng.standard_normal(1000) * 1000
    if name == "BF16":
        data = values.astype("<f4").view("<u4") >> 16
        data = data.astype("<u2")
    else:
        data = values.astype(FLOAT_TYPES[name])
    assert validate_row_data(name, data) is None
    assert validate_row_data(name, memoryview(data.tobytes())) is None


def _float_bits(name: str, word: str, negative: bool) -> bytes:
    sign = -1.0 if negative else 1.0
    if name == "BF16":
        return np.array([(0xFF80 if negative else 0x7F80) if word == "Inf" else 0x7FC1], "<u2").tobytes()
    value = sign * (np.inf if word == "Inf" else np.nan)
    return np.array([value], FLOAT_TYPES[name]).tobytes()


@pytest.mark.parametrize("name", sorted(FLOAT_TYPES))
@pytest.mark.parametrize("word", ["NaN", "Inf"])
@pytest.mark.parametrize("negative", [False, True])
def test_bad_float_is_reported_at_its_element(name: str, word: str, negative: bool) -> None:
    size = GGML_TYPES_BY_NAME[name].type_size
    data = bytearray(np.ones(100, FLOAT_TYPES[name]).tobytes())
    bad = _float_bits(name, word, negative)
    data[37 * size : 38 * size] = bad
    data[90 * size : 91 * size] = bad
    assert validate_row_data(name, memoryview(data)) == InvalidData(f"{word} at element 37", 37 * size)


@pytest.mark.parametrize(
    ("bits", "ok"),
    [(0x7BFF, True), (0xFBFF, True), (0x0001, True), (0x8000, True), (0x7C00, False), (0xFC00, False), (0x7C01, False)],
)
def test_f16_edges(bits: int, ok: bool) -> None:
    got = validate_row_data("F16", np.array([0, bits], "<u2"))
    assert (got is None) == ok
    if not ok:
        assert got is not None and got.offset == 2


@pytest.mark.parametrize(
    ("bits", "ok"),
    [
        (0x7F7F, True),
        (0xFF7F, True),
        (0x0001, True),
        (0x7F80, False),
        (0xFF80, False),
        (0x7F81, False),
        (0xFFC0, False),
    ],
)
def test_bf16_edges(bits: int, ok: bool) -> None:
    assert (validate_row_data("BF16", np.array([bits], "<u2")) is None) == ok


def test_bf16_reports_a_nan_before_an_earlier_inf() -> None:
    data = np.full(100, 0x3F80, "<u2")  # 1.0
    data[10] = 0x7F80
    data[60] = 0x7FC0
    assert validate_row_data("BF16", data) == InvalidData("NaN at element 60", 120)
    data[60] = 0x3F80
    assert validate_row_data("BF16", data) == InvalidData("Inf at element 10", 20)


def test_f64_is_checked_as_f32() -> None:
    """ggml converts each double to float before testing it: magnitudes that round to
    infinity in F32 are reported as Inf, smaller ones pass."""
    limit = 2.0**128 - 2.0**103
    below = np.nextafter(limit, 0.0)
    with np.errstate(over="ignore"):
        assert np.isinf(np.float32(limit)) and np.isfinite(np.float32(below))
    for value in [below, -below, float(np.finfo(np.float32).max), 1e-300, 5e-324]:
        assert validate_row_data("F64", np.array([1.0, value])) is None, value
    for value in [limit, -limit, 1e39, -1e300, float(np.finfo(np.float64).max)]:
        got = validate_row_data("F64", np.array([1.0, value]))
        assert got is not None and got.offset == 8 and got.reason.startswith("Inf at element 1 ("), value


@pytest.mark.parametrize("name", ["I8", "I16", "I32", "I64"])
def test_integers_are_always_valid(name: str) -> None:
    data = np.random.default_rng(6).integers(0, 256, 64 * 8, dtype=np.uint8)
    data[:16] = 0xFF
    assert validate_row_data(name, data) is None


def test_nvfp4_is_not_checked() -> None:
    assert validate_row_data("NVFP4", np.full(36 * 10, 0xFF, np.uint8)) is None
    assert validate_row_data("NVFP4", np.random.default_rng(7).integers(0, 256, 36 * 10, dtype=np.uint8)) is None


def test_q8_1_is_rejected_as_ggml_does() -> None:
    blocks = np.zeros((4, 36), np.uint8)  # ggml's block_q8_1: half2 ds + 32 int8
    got = validate_row_data("Q8_1", blocks)
    assert got is not None and got.offset == 0 and "Q8_1" in got.reason
    assert validate_row_data("Q8_1", b"") == got
    size = validate_row_data("Q8_1", bytes(41))
    assert size is not None and "invalid size 41 bytes" in size.reason


@pytest.mark.parametrize("name", sorted(GGML_TYPES_BY_NAME))
def test_size_must_be_whole_blocks(name: str) -> None:
    ts = GGML_TYPES_BY_NAME[name].type_size
    if name not in REJECTED_TYPES:
        assert validate_row_data(name, b"") is None
    if ts == 1:
        return
    for nbytes in [1, ts - 1, 3 * ts + 1]:
        got = validate_row_data(name, bytes(nbytes))
        assert got == InvalidData(
            f"invalid size {nbytes} bytes for type {name}: not a multiple of its type size {ts} bytes",
            nbytes - nbytes % ts,
        )


def test_unknown_type_raises() -> None:
    for name in ["Q4_2", "q4_k", "", "F8"]:
        with pytest.raises(ValueError, match="unknown ggml type"):
            validate_row_data(name, b"")


def test_input_kinds() -> None:
    values = np.array([[1.0, 2.0, np.nan, 4.0], [5.0, 6.0, 7.0, 8.0]], np.float32)
    expected = InvalidData("NaN at element 2", 8)
    as_bytes = values.tobytes()
    assert validate_row_data("F32", values) == expected
    assert validate_row_data("F32", as_bytes) == expected
    assert validate_row_data("F32", memoryview(as_bytes)) == expected
    assert validate_row_data("F32", memoryview(bytearray(as_bytes))) == expected
    assert validate_row_data("F32", memoryview(values)) == expected
    read_only = np.frombuffer(as_bytes, np.uint8).reshape(2, 16)
    assert not read_only.flags.writeable
    assert validate_row_data("F32", read_only) == expected
    # non-contiguous input is checked as its elements in order
    assert validate_row_data("F32", values[:, ::2]) == InvalidData("NaN at element 1", 4)
    assert validate_row_data("F32", memoryview(values.reshape(-1))[::2]) == InvalidData("NaN at element 1", 4)


def test_contiguous_input_is_not_copied() -> None:
    data = np.zeros((4, 34), np.uint8)
    data.flags.writeable = False
    assert np.shares_memory(validate._as_bytes(data), data)
    raw = bytes(68)
    assert np.shares_memory(validate._as_bytes(raw), np.frombuffer(raw, np.uint8))


@pytest.mark.parametrize("name", ["F16", "BF16", "F32", "F64", "Q8_0", "Q4_K", "IQ1_M", "MXFP4"])
def test_scan_across_chunks(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(validate, "_CHUNK_NBYTES", 100)
    rng = np.random.default_rng(8)
    if name in FLOAT_TYPES:
        size = GGML_TYPES_BY_NAME[name].type_size
        data = bytearray(np.ones(500, FLOAT_TYPES[name]).tobytes())
        data[411 * size : 412 * size] = _float_bits(name, "Inf", False)
        assert validate_row_data(name, memoryview(data)) == InvalidData("Inf at element 411", 411 * size)
        if name == "BF16":
            data[5 * size : 6 * size] = _float_bits(name, "Inf", False)
            data[450 * size : 451 * size] = _float_bits(name, "NaN", False)
            assert validate_row_data(name, memoryview(data)) == InvalidData("NaN at element 450", 450 * size)
        return
    ts = GGML_TYPES_BY_NAME[name].type_size
    _, off, kind = BLOCK_SCALES[name][-1]
    blocks = _valid_blocks(name, 50, rng)
    _set_scale(blocks, 41, off, kind, 0xFF if kind == E8M0 else 0x7C00, rng)
    got = validate_row_data(name, blocks)
    assert got is not None and got.offset == 41 * ts + off


QUANTIZABLE = ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "TQ1_0", "TQ2_0", "MXFP4"]


@pytest.mark.parametrize("name", QUANTIZABLE)
def test_gguf_quantized_data_validates(name: str) -> None:
    rng = np.random.default_rng(9)
    weights = (rng.standard_normal((16, 512)) * rng.uniform(1e-3, 10, (16, 1))).astype(np.float32)
    weights[0] = 0.0  # all-zero blocks
    data = quantize(weights, gguf.GGMLQuantizationType[name])
    assert validate_row_data(name, data) is None
    assert validate_row_data("F32", weights) is None


@pytest.mark.sample
def test_sample_model_validates(sample_name: str, sample_path: Path) -> None:
    """Every tensor of each bundled model is valid, read from the mapped file; a NaN in one
    block scale of its quantized data is then found and placed."""
    facts = FACTS[sample_name]
    bad_type, block_nbytes, scale, at = facts.bad_scale
    gguf_file = read_gguf(sample_path)
    types = {t.ggml_type.name for t in gguf_file.tensors}
    assert types == set(facts.tensor_types)
    with open(sample_path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        data = np.frombuffer(mapped, np.uint8)
        try:
            for t in gguf_file.tensors:
                start = gguf_file.data_offset + t.offset
                assert validate_row_data(t.ggml_type.name, data[start : start + t.nbytes]) is None, t.name
            # the same bytes with a NaN scale in one block are rejected
            quantized = next(t for t in gguf_file.tensors if t.ggml_type.name == bad_type)
            start = gguf_file.data_offset + quantized.offset
            copy = data[start : start + quantized.nbytes].copy()
        finally:
            del data
    copy[7 * block_nbytes + at : 7 * block_nbytes + at + 2] = np.array([0x7E00], "<u2").view(np.uint8)
    expected = InvalidData(f"NaN in the block scale {scale} of block 7", 7 * block_nbytes + at)
    assert validate_row_data(bad_type, copy) == expected


def test_64_mib_q8_0_is_fast() -> None:
    n_blocks = (64 << 20) // 34
    data = np.zeros((n_blocks, 34), np.uint8)
    data[:, 2:] = 0x7F  # quants are never looked at
    data[:, 0:2] = np.array([0x3C00], "<u2").view(np.uint8)  # d = 1.0
    data.flags.writeable = False
    start = time.perf_counter()
    assert validate_row_data("Q8_0", data) is None
    assert validate_row_data("Q8_0", memoryview(data)) is None
    elapsed = time.perf_counter() - start
    assert elapsed < 2.0, elapsed
    bad = data.copy()
    bad[n_blocks - 1, 0:2] = np.array([0xFC00], "<u2").view(np.uint8)
    assert validate_row_data("Q8_0", bad) == InvalidData(
        f"Inf in the block scale d of block {n_blocks - 1}", (n_blocks - 1) * 34
    )
