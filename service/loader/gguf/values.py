"""KV values that are arrays: kept as raw bytes and decoded on demand.

Metadata arrays can be large (a 262,144-token vocabulary is a string array of that many
elements plus float and int arrays of the same length); decoding them into Python
objects at parse time dominated the cost of reading a header. A :class:`GGUFArray` keeps
the bytes of its payload and decodes them vectorised (numeric types, with numpy) or on
request (strings).

Strings are UTF-8 in GGUF. String *values* are decoded with ``errors="replace"``, so an
invalid byte sequence shows as U+FFFD and never fails a load (hoist does not tokenize);
``string_bytes`` gives the exact bytes. Keys and tensor names must be valid UTF-8: the
reader rejects them otherwise.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGUFValueType

from service.loader.gguf.constants import NUMPY_CODES

_U64 = {"<": struct.Struct("<Q"), ">": struct.Struct(">Q")}


@dataclass(frozen=True, slots=True)
class GGUFArray:
    """An array KV value.

    Attributes:
        element_type: the value type of every element (never ``ARRAY``: nested arrays
            are rejected by the reader, as llama.cpp does).
        count: number of elements.
        payload: the raw bytes of the elements as stored in the file.
        byte_order: ``"<"`` (little-endian) or ``">"`` (big-endian).
    """

    element_type: GGUFValueType
    count: int
    payload: bytes
    byte_order: str = "<"

    def __len__(self) -> int:
        return self.count

    @property
    def type_name(self) -> str:
        """``ARRAY[<element type>]``, e.g. ``ARRAY[STRING]``."""
        return f"ARRAY[{self.element_type.name}]"

    def numpy(self) -> np.ndarray[Any, np.dtype[Any]]:
        """The elements as a read-only numpy array (numeric and bool arrays only).

        Raises:
            TypeError: for string arrays.
        """
        if self.element_type == GGUFValueType.STRING:
            raise TypeError("a string array has no numpy form; use strings()")
        values: np.ndarray[Any, np.dtype[Any]] = np.frombuffer(
            self.payload, dtype=self.byte_order + NUMPY_CODES[self.element_type]
        )
        if self.element_type == GGUFValueType.BOOL:
            flags: np.ndarray[Any, np.dtype[Any]] = values != 0
            return flags
        return values

    def iter_string_bytes(self) -> Iterator[bytes]:
        """The raw bytes of each string element, in order."""
        unpack = _U64[self.byte_order].unpack_from
        payload = self.payload
        pos = 0
        for _ in range(self.count):
            (length,) = unpack(payload, pos)
            pos += 8
            yield payload[pos : pos + length]
            pos += length

    def string_bytes(self) -> list[bytes]:
        """The raw bytes of every string element."""
        return list(self.iter_string_bytes())

    def strings(self) -> list[str]:
        """Every string element, decoded as UTF-8 with invalid bytes replaced."""
        return [b.decode("utf-8", "replace") for b in self.iter_string_bytes()]

    def head(self, n: int) -> list[Any]:
        """The first ``n`` elements as Python values (cheap on large arrays)."""
        if self.element_type == GGUFValueType.STRING:
            out: list[Any] = []
            for i, raw in enumerate(self.iter_string_bytes()):
                if i >= n:
                    break
                out.append(raw.decode("utf-8", "replace"))
            return out
        head: list[Any] = self.numpy()[:n].tolist()
        return head

    def to_list(self) -> list[Any]:
        """Every element as a Python value."""
        if self.element_type == GGUFValueType.STRING:
            return self.strings()
        values: list[Any] = self.numpy().tolist()
        return values
