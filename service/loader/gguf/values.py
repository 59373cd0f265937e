"""KV values as the file holds them: floats with their exact bits, strings with their
exact bytes, arrays kept as raw bytes and decoded on demand.

Metadata arrays can be large (a 262,144-token vocabulary is a string array of that many
elements plus float and int arrays of the same length); decoding them into Python
objects at parse time dominated the cost of reading a header. A :class:`GGUFArray` keeps
the bytes of its payload and decodes them vectorised (numeric types, with numpy) or on
request (strings).

Floats: a FLOAT32 or FLOAT64 value is a :class:`GGUFFloat`, a ``float`` that also keeps
the value's bit pattern, so that a NaN's payload (a signalling NaN, say) survives: a
float32 converted to a Python float would come back as a different NaN.

Strings are UTF-8 in GGUF. String *values* (single and array elements) are decoded with
``errors="replace"``, so an invalid byte sequence shows as U+FFFD and never fails a load
(hoist does not tokenize); a single value is a :class:`GGUFString` whose ``raw`` holds the
exact bytes, and an array gives them with :meth:`GGUFArray.string_bytes`. Keys and tensor
names must be valid UTF-8 without NUL: the reader rejects them otherwise.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from service.loader.gguf.constants import NUMPY_CODES, SCALAR_FORMATS, GGUFValueType

if TYPE_CHECKING:
    import numpy as np

_U64 = {"<": struct.Struct("<Q"), ">": struct.Struct(">Q")}

_FLOAT_FORMATS = {4: "f", 8: "d"}
_FLOAT_TYPES = {GGUFValueType.FLOAT32: 4, GGUFValueType.FLOAT64: 8}


class GGUFFloat(float):
    """A FLOAT32 or FLOAT64 value and its exact bit pattern.

    It is a ``float`` (compares and computes as its value); ``bits`` and ``width`` keep
    what the file holds, so that :meth:`to_bytes` gives back the same bytes even for a NaN
    whose payload a conversion to ``float`` would change.

    Attributes:
        bits: the IEEE-754 bit pattern as an unsigned integer.
        width: 4 (FLOAT32) or 8 (FLOAT64) bytes.
    """

    __slots__ = ("bits", "width")
    bits: int
    width: int

    def __new__(cls, bits: int, width: int) -> GGUFFloat:
        if width not in _FLOAT_FORMATS or not 0 <= bits < 1 << (8 * width):
            raise ValueError(f"no {width}-byte float has the bits {bits:#x}")
        (value,) = struct.unpack("<" + _FLOAT_FORMATS[width], bits.to_bytes(width, "little"))
        obj = super().__new__(cls, value)
        obj.bits = bits
        obj.width = width
        return obj

    @classmethod
    def from_bytes(cls, raw: bytes, byte_order: str = "<") -> GGUFFloat:
        """The float stored in ``raw`` (4 or 8 bytes) in ``byte_order`` (``"<"`` or ``">"``)."""
        return cls(int.from_bytes(raw, "little" if byte_order == "<" else "big"), len(raw))

    def to_bytes(self, byte_order: str = "<") -> bytes:
        """The value's bytes in ``byte_order``, exactly as read."""
        return self.bits.to_bytes(self.width, "little" if byte_order == "<" else "big")

    def __reduce__(self) -> tuple[Any, ...]:
        return (GGUFFloat, (self.bits, self.width))


class GGUFString(str):
    """A STRING value: its text, with invalid UTF-8 shown as U+FFFD, and its exact bytes.

    Attributes:
        raw: the bytes as stored in the file.
    """

    raw: bytes

    def __new__(cls, raw: bytes) -> GGUFString:
        obj = super().__new__(cls, raw.decode("utf-8", "replace"))
        obj.raw = raw
        return obj

    @property
    def valid_utf8(self) -> bool:
        """Whether ``raw`` is valid UTF-8 (the text then holds it exactly)."""
        return is_utf8(self.raw)

    def __reduce__(self) -> tuple[Any, ...]:
        return (GGUFString, (self.raw,))


def is_utf8(raw: bytes) -> bool:
    """Whether ``raw`` is valid UTF-8."""
    if raw.isascii():
        return True
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


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
        import numpy as np

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

    def invalid_utf8(self) -> dict[int, bytes]:
        """The string elements that are not valid UTF-8, by index, with their bytes."""
        return {i: raw for i, raw in enumerate(self.iter_string_bytes()) if not is_utf8(raw)}

    def float_bits(self) -> np.ndarray[Any, np.dtype[Any]]:
        """The bit patterns of a float array's elements, as unsigned integers of their width.

        Raises:
            TypeError: for arrays of other types.
        """
        width = _FLOAT_TYPES.get(self.element_type)
        if width is None:
            raise TypeError(f"an array of {self.element_type.name} has no float bits")
        import numpy as np

        bits: np.ndarray[Any, np.dtype[Any]] = np.frombuffer(self.payload, dtype=f"{self.byte_order}u{width}")
        return bits

    def head(self, n: int) -> list[Any]:
        """The first ``n`` elements as Python values (cheap on large arrays), as
        :meth:`to_list` gives them."""
        if self.element_type == GGUFValueType.STRING:
            out: list[Any] = []
            for i, raw in enumerate(self.iter_string_bytes()):
                if i >= n:
                    break
                out.append(GGUFString(raw))
            return out
        return self._numbers(max(0, min(n, self.count)))

    def to_list(self) -> list[Any]:
        """Every element as a Python value: :class:`GGUFString` for strings,
        :class:`GGUFFloat` for floats (bit-exact), ``int`` or ``bool`` otherwise."""
        if self.element_type == GGUFValueType.STRING:
            return [GGUFString(raw) for raw in self.iter_string_bytes()]
        return self._numbers(self.count)

    def _numbers(self, n: int) -> list[Any]:
        """The first ``n`` (<= ``count``) elements of a numeric or bool array, decoded
        with ``struct`` (no numpy needed for a table's head)."""
        width = _FLOAT_TYPES.get(self.element_type)
        if width is not None:
            code = "I" if width == 4 else "Q"
            return [GGUFFloat(bits, width) for bits in struct.unpack_from(f"{self.byte_order}{n}{code}", self.payload)]
        fmt = SCALAR_FORMATS[self.element_type][0]
        values = list(struct.unpack_from(f"{self.byte_order}{n}{fmt}", self.payload))
        if self.element_type == GGUFValueType.BOOL:
            return [v != 0 for v in values]
        return values
