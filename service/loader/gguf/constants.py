"""The GGUF format written down as data (the parts llama.cpp's ``gguf.cpp`` enforces)."""

from __future__ import annotations

from enum import IntEnum


class GGUFValueType(IntEnum):
    """The type of a KV value (``enum gguf_type`` in ``gguf.h``), with the same numbers and
    names as gguf-py's ``GGUFValueType`` (an ``IntEnum`` too, so the two compare equal).
    Defined here so that reading a header does not import gguf-py and its dependencies."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
"""Versions hoist reads. Version 1 used 32-bit counts and is no longer supported."""

DEFAULT_ALIGNMENT = 32
"""``GGUF_DEFAULT_ALIGNMENT``: data alignment when ``general.alignment`` is absent."""

KEY_ALIGNMENT = "general.alignment"

MAX_NAME_BYTES = 63
"""Longest tensor name (``GGML_MAX_NAME`` is 64 including the terminating NUL). A name
may be empty."""

MAX_DIMS = 4
"""``GGML_MAX_DIMS``: a tensor info declares 0 (a scalar) to 4 dimensions."""

MAX_STRING_BYTES = 1 << 30
"""``GGUF_MAX_STRING_LENGTH``: longest string value or key, in bytes."""

MAX_ARRAY_ELEMENTS = 1 << 30
"""``GGUF_MAX_ARRAY_ELEMENTS``: most elements in one array value."""

INT64_MAX = (1 << 63) - 1

HEADER_NBYTES = 24
"""magic (4) + version (4) + n_tensors (8) + n_kv (8)."""

# struct format character and byte size of each scalar value type
SCALAR_FORMATS: dict[GGUFValueType, tuple[str, int]] = {
    GGUFValueType.UINT8: ("B", 1),
    GGUFValueType.INT8: ("b", 1),
    GGUFValueType.UINT16: ("H", 2),
    GGUFValueType.INT16: ("h", 2),
    GGUFValueType.UINT32: ("I", 4),
    GGUFValueType.INT32: ("i", 4),
    GGUFValueType.FLOAT32: ("f", 4),
    GGUFValueType.BOOL: ("b", 1),
    GGUFValueType.UINT64: ("Q", 8),
    GGUFValueType.INT64: ("q", 8),
    GGUFValueType.FLOAT64: ("d", 8),
}

# numpy dtype code of each scalar value type (without the byte-order prefix)
NUMPY_CODES: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "u1",
    GGUFValueType.INT8: "i1",
    GGUFValueType.UINT16: "u2",
    GGUFValueType.INT16: "i2",
    GGUFValueType.UINT32: "u4",
    GGUFValueType.INT32: "i4",
    GGUFValueType.FLOAT32: "f4",
    GGUFValueType.BOOL: "i1",
    GGUFValueType.UINT64: "u8",
    GGUFValueType.INT64: "i8",
    GGUFValueType.FLOAT64: "f8",
}

# smallest encodings, used to bound counts by the bytes that remain before looping
MIN_KV_NBYTES = 8 + 1 + 4 + 1
"""key length, a 1-byte key, value type, a 1-byte value."""
MIN_TENSOR_INFO_NBYTES = 8 + 4 + 4 + 8
"""name length (the name may be empty), n_dims (0 for a scalar: no dimensions), ggml type,
offset."""
