"""The ggml type table: block size and type size of every ggml type a GGUF file may use.

The facts come from hoist's own copy of ggml's table (:mod:`service.loader.ggml_type_table`,
generated from llama.cpp's ggml sources by ``scripts/ggml_types.py``); this module gives
them a type and the byte arithmetic of ``ggml_nbytes`` / ``ggml_row_size``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

from service.loader.ggml_type_table import GGML_TYPE_COUNT, GGML_TYPE_ROWS

__all__ = [
    "ALL_GGML_TYPES",
    "GGML_TYPES",
    "GGML_TYPES_BY_NAME",
    "GGML_TYPE_COUNT",
    "REMOVED_GGML_TYPES",
    "GGMLType",
    "numpy_dtype",
    "numpy_shape",
]


@dataclass(frozen=True, slots=True)
class GGMLType:
    """One ggml type (an entry of ggml's ``type_traits``).

    Attributes:
        id: the numeric type stored in a GGUF tensor info (``enum ggml_type``).
        name: the enum name without ``GGML_TYPE_`` (``F32``, ``Q4_K``, ...).
        type_name: ggml's short name (``f32``, ``q4_K``, ...); empty for removed types.
        block_size: elements per block (1 for plain types; 0 for removed types).
        type_size: bytes per block (0 for removed types).
        quantized: ggml's ``is_quantized`` flag.
        removed: ggml dropped support for the type; its id stays reserved and a GGUF
            tensor of it is refused.
    """

    id: int
    name: str
    type_name: str
    block_size: int
    type_size: int
    quantized: bool
    removed: bool = False

    def row_nbytes(self, ne0: int) -> int:
        """Bytes in one row of ``ne0`` elements (``ggml_row_size``); ``ne0`` must be a
        multiple of ``block_size``."""
        return ne0 // self.block_size * self.type_size

    def nbytes(self, ne: tuple[int, ...]) -> int:
        """Bytes of a tensor with dimensions ``ne`` (ggml order, ``ne[0]`` = row length;
        missing dimensions count as 1, so ``()`` is a scalar), as ``ggml_nbytes``
        computes it for a contiguous tensor."""
        n_rows = 1
        for n in ne[1:]:
            n_rows *= n
        return self.row_nbytes(ne[0] if ne else 1) * n_rows


ALL_GGML_TYPES: dict[int, GGMLType] = {row[0]: GGMLType(*row) for row in GGML_TYPE_ROWS}
"""Every id of ``[0, GGML_TYPE_COUNT)``, removed types included."""

GGML_TYPES: dict[int, GGMLType] = {i: t for i, t in ALL_GGML_TYPES.items() if not t.removed}
"""The ggml types a GGUF tensor may have, by id."""

REMOVED_GGML_TYPES: dict[int, GGMLType] = {i: t for i, t in ALL_GGML_TYPES.items() if t.removed}
"""Ids ggml reserves for types whose support was removed (block size 0)."""

GGML_TYPES_BY_NAME: dict[str, GGMLType] = {t.name: t for t in GGML_TYPES.values()}
"""The ggml types a GGUF tensor may have, by name."""

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
    import numpy as np

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
    return (*reversed(ne[1:]), ggml_type.row_nbytes(ne[0] if ne else 1))
