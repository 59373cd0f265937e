"""Row-data validation: hoist's port of ggml's ``ggml_validate_row_data``.

llama.cpp runs ``ggml_validate_row_data`` (``ggml/src/ggml-quants.c``) on every tensor's
data when ``--check-tensors`` is given. This module applies the same rules to a tensor's
raw bytes:

* the size must be a whole number of blocks (``nbytes % type_size == 0``);
* F16, BF16, F32 and F64 data must hold no NaN and no infinity;
* block-quantized data must hold no NaN or infinity in the per-block scales that ggml
  checks (``d``, and ``m`` / ``dmin`` where the block has one; an E8M0 exponent of 0xff
  for MXFP4); the packed quants are never checked;
* integer data, and NVFP4 (whose one-byte UE4M3 scales have no NaN or infinity), are
  always valid;
* Q8_1 has no rule in ggml and is rejected like an unknown type.

Where ggml's checks are stricter or looser than "finite values", the port follows ggml:
F64 values are checked after conversion to F32 (so a finite double beyond the F32 range
counts as infinity), and BF16 reports a NaN anywhere before an infinity that comes first.

Data is read in the little-endian byte order of GGUF files. The checks are vectorised
with numpy over chunks of the data; the data itself is never copied (except a
non-contiguous numpy array, which is made contiguous once).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from service.loader.ggml_types import GGML_TYPES_BY_NAME

__all__ = ["InvalidData", "validate_row_data"]


@dataclass(frozen=True, slots=True)
class InvalidData:
    """First problem found in a tensor's data.

    Attributes:
        reason: what is wrong and where, e.g. ``"NaN in the block scale d of block 17"``
            or ``"Inf at element 3"``.
        offset: byte offset of the bad value from the start of the data.
    """

    reason: str
    offset: int


_ScaleKind = Literal["f16", "f32", "e8m0", "iq1m"]


@dataclass(frozen=True, slots=True)
class _Scale:
    """One checked scale field of a block.

    Attributes:
        name: the field name in ggml's block struct.
        offset: byte offset of the field within the block.
        kind: how the field is stored: ``f16`` (IEEE half), ``f32`` (IEEE single),
            ``e8m0`` (an 8-bit power-of-two exponent, 0xff reserved), or ``iq1m``
            (an IEEE half packed into the top nibbles of four 16-bit words).
    """

    name: str
    offset: int
    kind: _ScaleKind


def _d(offset: int = 0) -> tuple[_Scale, ...]:
    return (_Scale("d", offset, "f16"),)


# Checked scale fields per block-quantized type, in the order ggml checks them within a
# block. Offsets follow the block structs of ggml-common.h (QK_K = 256).
_BLOCK_SCALES: dict[str, tuple[_Scale, ...]] = {
    "Q1_0": _d(),
    "Q2_0": _d(),
    "Q4_0": _d(),
    "Q4_1": (_Scale("d", 0, "f16"), _Scale("m", 2, "f16")),
    "Q5_0": _d(),
    "Q5_1": (_Scale("d", 0, "f16"), _Scale("m", 2, "f16")),
    "Q8_0": _d(),
    "MXFP4": (_Scale("e", 0, "e8m0"),),
    # scales[16], qs[64], then d and dmin
    "Q2_K": (_Scale("d", 80, "f16"), _Scale("dmin", 82, "f16")),
    # hmask[32], qs[64], scales[12], then d
    "Q3_K": _d(108),
    "Q4_K": (_Scale("d", 0, "f16"), _Scale("dmin", 2, "f16")),
    "Q5_K": (_Scale("d", 0, "f16"), _Scale("dmin", 2, "f16")),
    # ql[128], qh[64], scales[16], then d
    "Q6_K": _d(208),
    "Q8_K": (_Scale("d", 0, "f32"),),
    # qs[48], qh[4], then d
    "TQ1_0": _d(52),
    # qs[64], then d
    "TQ2_0": _d(64),
    "IQ1_S": _d(),
    # qs[32], qh[16], then scales[8], whose four 16-bit words carry the scale in their top nibbles
    "IQ1_M": (_Scale("scales", 48, "iq1m"),),
    "IQ2_XXS": _d(),
    "IQ2_XS": _d(),
    "IQ2_S": _d(),
    "IQ3_XXS": _d(),
    "IQ3_S": _d(),
    "IQ4_XS": _d(),
    "IQ4_NL": _d(),
}

# Plain floating-point types: every element is checked.
_FLOAT_TYPES = frozenset({"F16", "BF16", "F32", "F64"})

# Types whose data ggml accepts without looking at it.
_UNCHECKED_TYPES = frozenset({"I8", "I16", "I32", "I64", "NVFP4"})

# Types that ggml's validation does not handle: it rejects their data as an invalid type.
_REJECTED_TYPES = frozenset({"Q8_1"})

# Bytes of data examined per step: bounds the temporaries and stops early at a bad chunk.
_CHUNK_NBYTES = 1 << 24

# Smallest magnitude of a double that becomes infinity when rounded to single precision
# (halfway between FLT_MAX and 2**128; the tie rounds to the even mantissa, i.e. to 2**128).
_F64_OVERFLOWS_F32 = 2.0**128 - 2.0**103

_F16_EXPONENT = 0x7C00
_F16_MANTISSA = 0x03FF
_F32_EXPONENT = 0x7F800000
_F32_MANTISSA = 0x007FFFFF
_BF16_MAGNITUDE = 0x7FFF
_BF16_INF = 0x7F80
_E8M0_RESERVED = 0xFF

_FIELD_DTYPES: dict[_ScaleKind, Any] = {
    "f16": "<u2",
    "f32": "<u4",
    "e8m0": "u1",
    "iq1m": ("<u2", (4,)),
}


def validate_row_data(ggml_type: str, data: np.ndarray[Any, Any] | bytes | memoryview) -> InvalidData | None:
    """Check a tensor's data as llama.cpp's ``ggml_validate_row_data`` does.

    Args:
        ggml_type: the ggml type name of the data (``"F32"``, ``"Q4_K"``, ...).
        data: the tensor's raw bytes, little-endian: a C-contiguous numpy array (any
            dtype, read-only is fine; it is reinterpreted as bytes) or any object with the
            buffer protocol (``bytes``, ``memoryview``, ``mmap``). A size in bytes that
            is not a multiple of the type size is reported, not raised.

    Returns:
        ``None`` if ggml would accept the data, otherwise the first problem ggml would
        report: a size that is not a whole number of blocks (offset: the start of the
        incomplete last block), a NaN or infinity (offset: the first byte of the bad
        element or block scale), an E8M0 scale of 0xff, or a type ggml does not validate
        (offset 0).

    Raises:
        ValueError: ``ggml_type`` is not a ggml type name hoist knows.
    """
    info = GGML_TYPES_BY_NAME.get(ggml_type)
    if info is None:
        raise ValueError(f"unknown ggml type {ggml_type!r}")
    raw = _as_bytes(data)
    nbytes = raw.size
    if nbytes % info.type_size:
        return InvalidData(
            f"invalid size {nbytes} bytes for type {ggml_type}: not a multiple of its type size {info.type_size} bytes",
            nbytes - nbytes % info.type_size,
        )
    if ggml_type in _UNCHECKED_TYPES:
        return None
    if ggml_type in _REJECTED_TYPES:
        return InvalidData(f"ggml does not validate {ggml_type} data and rejects it as an invalid type", 0)
    if ggml_type == "F16":
        return _check_f16(raw)
    if ggml_type == "BF16":
        return _check_bf16(raw)
    if ggml_type == "F32":
        return _check_f32(raw)
    if ggml_type == "F64":
        return _check_f64(raw)
    scales = _BLOCK_SCALES.get(ggml_type)
    if scales is None:
        raise ValueError(f"no row-data validation rule for ggml type {ggml_type!r}")
    return _check_blocks(raw, info.type_size, scales)


def _as_bytes(data: np.ndarray[Any, Any] | bytes | memoryview) -> NDArray[np.uint8]:
    """``data`` as a flat uint8 array over the same memory."""
    if isinstance(data, memoryview) and not data.c_contiguous:
        data = np.asarray(data)
    if isinstance(data, np.ndarray):
        contiguous = np.ascontiguousarray(data)  # copies only non-contiguous input
        return contiguous.reshape(-1).view(np.uint8)
    return np.frombuffer(data, dtype=np.uint8)


def _first_true(count: int, step: int, mask_of: Callable[[slice], NDArray[np.bool_]]) -> int | None:
    """Index of the first True of a mask over ``count`` items, computed ``step`` items at a
    time by ``mask_of(slice)``; ``None`` when all are False."""
    for start in range(0, count, step):
        mask = mask_of(slice(start, min(start + step, count)))
        if mask.any():
            return start + int(mask.argmax())
    return None


def _nan_or_inf(is_nan: bool) -> str:
    return "NaN" if is_nan else "Inf"


def _check_ieee(raw: NDArray[np.uint8], width: int, exponent: int, mantissa: int) -> InvalidData | None:
    """First element whose exponent bits are all ones (NaN or Inf), ``width`` bytes each."""
    bits = raw.view(f"<u{width}")
    i = _first_true(bits.size, _CHUNK_NBYTES // width, lambda s: (bits[s] & exponent) == exponent)
    if i is None:
        return None
    return InvalidData(f"{_nan_or_inf(bool(bits[i] & mantissa))} at element {i}", width * i)


def _check_f16(raw: NDArray[np.uint8]) -> InvalidData | None:
    return _check_ieee(raw, 2, _F16_EXPONENT, _F16_MANTISSA)


def _check_f32(raw: NDArray[np.uint8]) -> InvalidData | None:
    return _check_ieee(raw, 4, _F32_EXPONENT, _F32_MANTISSA)


def _check_f64(raw: NDArray[np.uint8]) -> InvalidData | None:
    values = raw.view("<f8")

    def bad(s: slice) -> NDArray[np.bool_]:
        # NaN compares False, so it is caught along with magnitudes that overflow F32
        with np.errstate(invalid="ignore"):
            in_range: NDArray[np.bool_] = np.abs(values[s]) < _F64_OVERFLOWS_F32
        return ~in_range

    i = _first_true(values.size, _CHUNK_NBYTES // 8, bad)
    if i is None:
        return None
    value = float(values[i])
    if np.isnan(value):
        reason = f"NaN at element {i}"
    elif np.isinf(value):
        reason = f"Inf at element {i}"
    else:
        reason = f"Inf at element {i} ({value!r} overflows F32)"
    return InvalidData(reason, 8 * i)


def _check_bf16(raw: NDArray[np.uint8]) -> InvalidData | None:
    # ggml counts NaNs and infinities over the whole row and reports NaNs first.
    magnitude_of = raw.view("<u2")
    step = _CHUNK_NBYTES // 2
    first_inf: int | None = None
    for start in range(0, magnitude_of.size, step):
        magnitude = magnitude_of[start : start + step] & _BF16_MAGNITUDE
        nan = magnitude > _BF16_INF
        if nan.any():
            i = start + int(nan.argmax())
            return InvalidData(f"NaN at element {i}", 2 * i)
        if first_inf is None:
            inf = magnitude == _BF16_INF
            if inf.any():
                first_inf = start + int(inf.argmax())
    if first_inf is None:
        return None
    return InvalidData(f"Inf at element {first_inf}", 2 * first_inf)


def _block_dtype(type_size: int, scales: tuple[_Scale, ...]) -> np.dtype[np.void]:
    """A structured dtype of one block exposing only the checked scale fields."""
    return np.dtype(
        {
            "names": [s.name for s in scales],
            "formats": [_FIELD_DTYPES[s.kind] for s in scales],
            "offsets": [s.offset for s in scales],
            "itemsize": type_size,
        }
    )


def _iq1m_scale(words: NDArray[Any]) -> NDArray[Any]:
    """The IEEE half scale of IQ1_M blocks from their four 16-bit ``scales`` words (shape
    ``(n, 4)``): the top nibble of word k is nibble k of the half."""
    return (words[:, 0] >> 12) | ((words[:, 1] >> 8) & 0x00F0) | ((words[:, 2] >> 4) & 0x0F00) | (words[:, 3] & 0xF000)


def _bad_scales(kind: _ScaleKind, values: NDArray[Any]) -> NDArray[np.bool_]:
    """Which of the scale ``values`` (one per block) ggml rejects."""
    bad: NDArray[np.bool_]
    if kind == "e8m0":
        bad = values == _E8M0_RESERVED
    elif kind == "f32":
        bad = (values & _F32_EXPONENT) == _F32_EXPONENT
    else:
        halves = _iq1m_scale(values) if kind == "iq1m" else values
        bad = (halves & _F16_EXPONENT) == _F16_EXPONENT
    return bad


def _describe_scale(scale: _Scale, value: NDArray[Any], block: int) -> str:
    """The reason for a bad scale; ``value`` holds the field of that one block (shape ``(1, ...)``)."""
    where = f"the block scale {scale.name} of block {block}"
    if scale.kind == "e8m0":
        return f"reserved E8M0 value 0xff (NaN) in {where}"
    if scale.kind == "f32":
        return f"{_nan_or_inf(bool(int(value[0]) & _F32_MANTISSA))} in {where}"
    if scale.kind == "iq1m":
        half = int(_iq1m_scale(value)[0])
        return f"{_nan_or_inf(bool(half & _F16_MANTISSA))} in {where} (the half packed in its top nibbles)"
    return f"{_nan_or_inf(bool(int(value[0]) & _F16_MANTISSA))} in {where}"


def _check_blocks(raw: NDArray[np.uint8], type_size: int, scales: tuple[_Scale, ...]) -> InvalidData | None:
    blocks = raw.view(_block_dtype(type_size, scales))
    fields = [blocks[s.name] for s in scales]

    def bad(s: slice) -> NDArray[np.bool_]:
        mask = _bad_scales(scales[0].kind, fields[0][s])
        for scale, field in zip(scales[1:], fields[1:], strict=True):
            mask |= _bad_scales(scale.kind, field[s])
        return mask

    i = _first_true(blocks.size, max(1, _CHUNK_NBYTES // type_size), bad)
    if i is None:
        return None
    for scale, field in zip(scales, fields, strict=True):
        value = field[i : i + 1]
        if _bad_scales(scale.kind, value).any():
            return InvalidData(_describe_scale(scale, value, i), i * type_size + scale.offset)
    raise AssertionError("a bad block has no bad scale")  # unreachable: the mask came from these fields
