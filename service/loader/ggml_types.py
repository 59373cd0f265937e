"""The ggml type table: block size and type size of every ggml type a GGUF file may use.

The sizes come from the ``gguf`` package (``gguf.GGML_QUANT_SIZES``), the same table
llama.cpp's converters use; this module only gives it ggml's names and the byte
arithmetic of ``ggml_nbytes`` / ``ggml_row_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np


@dataclass(frozen=True, slots=True)
class GGMLType:
    """One ggml type.

    Attributes:
        id: the numeric type stored in a GGUF tensor info.
        name: ggml's type name (``F32``, ``Q4_K``, ...).
        block_size: elements per block (1 for plain types).
        type_size: bytes per block.
    """

    id: int
    name: str
    block_size: int
    type_size: int

    @property
    def quantized(self) -> bool:
        """True for block-quantized types (more than one element per block)."""
        return self.block_size > 1

    def row_nbytes(self, ne0: int) -> int:
        """Bytes in one row of ``ne0`` elements (``ggml_row_size``); ``ne0`` must be a
        multiple of ``block_size``."""
        return ne0 // self.block_size * self.type_size

    def nbytes(self, ne: tuple[int, ...]) -> int:
        """Bytes of a tensor with dimensions ``ne`` (ggml order, ``ne[0]`` = row length),
        as ``ggml_nbytes`` computes it for a contiguous tensor."""
        n_rows = 1
        for n in ne[1:]:
            n_rows *= n
        return self.row_nbytes(ne[0]) * n_rows


GGML_TYPES: dict[int, GGMLType] = {
    int(t): GGMLType(int(t), t.name, block, size) for t, (block, size) in gguf.GGML_QUANT_SIZES.items()
}
"""All known ggml types by id."""

GGML_TYPES_BY_NAME: dict[str, GGMLType] = {t.name: t for t in GGML_TYPES.values()}
"""All known ggml types by name."""

# numpy element types of the plain (non-block) ggml types; BF16 has no numpy type and is
# exposed as its raw 16-bit patterns.
_NUMPY_DTYPES: dict[str, str] = {
    "F32": "f4",
    "F16": "f2",
    "BF16": "u2",
    "F64": "f8",
    "I8": "i1",
    "I16": "i2",
    "I32": "i4",
    "I64": "i8",
}


def numpy_dtype(ggml_type: GGMLType, byte_order: str = "<") -> np.dtype[np.generic]:
    """The numpy dtype of one element of a plain ggml type, or ``uint8`` (one byte of a
    block) for block-quantized types. ``byte_order`` is ``"<"`` or ``">"``."""
    code = _NUMPY_DTYPES.get(ggml_type.name)
    if code is None:
        return np.dtype(np.uint8)
    return np.dtype(byte_order + code)


def numpy_shape(ggml_type: GGMLType, ne: tuple[int, ...]) -> tuple[int, ...]:
    """The numpy shape of a tensor's data: ``ne`` reversed (numpy is row-major, ggml lists
    the fastest dimension first); for block-quantized types the last axis is the row's
    bytes, ``ne[0] / block_size * type_size``."""
    if ggml_type.name in _NUMPY_DTYPES:
        return tuple(reversed(ne))
    return (*reversed(ne[1:]), ggml_type.row_nbytes(ne[0]))
