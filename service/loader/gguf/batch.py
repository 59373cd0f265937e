"""The common case of a GGUF header parsed in tight loops over the bytes already read,
for :mod:`.reader`, which falls back on its careful one-field-at-a-time walk for anything
these loops do not settle.

Both loops here only ever *stop early*: an item they cannot vouch for (a value the
careful walk would refuse, an unusual but valid shape, bytes not read yet) is left,
with everything after it, to the careful walk, which then reads it, reports its error
with the exact message and byte offset, or parses it. So the result of a parse never
depends on which of the two read an item; the tests parse with and without these loops
and compare.

- :func:`skip_strings` skips the elements of a string array (``gguf.cpp`` reads each
  with ``gguf_reader::read``): one ``unpack_from`` and one addition per element, the
  bounds check left to the buffer's end.
- :func:`tensor_infos` reads tensor infos (``gguf.cpp``'s loop over
  ``gguf_tensor_info``) with one ``unpack_from`` for the dimensions, type and offset of
  each.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from typing import Any

from service.loader.ggml_types import GGML_TYPES
from service.loader.gguf.constants import INT64_MAX, MAX_DIMS, MAX_NAME_BYTES, MAX_STRING_BYTES

_U64 = {"<": struct.Struct("<Q").unpack_from, ">": struct.Struct(">Q").unpack_from}
_U32 = {"<": struct.Struct("<I").unpack_from, ">": struct.Struct(">I").unpack_from}
_SHAPE_TYPE_OFFSET = {
    (order, n): struct.Struct(f"{order}{n}qiQ").unpack_from for order in "<>" for n in range(1, MAX_DIMS + 1)
}
"""``ne[0..n)`` (i64 each), the ggml type (i32) and the data offset (u64), by byte order
and ``n_dims``."""


def skip_strings(data: bytearray, pos: int, first: int, stop: int, byte_order: str) -> tuple[int, int]:
    """Skip strings ``first`` to ``stop - 1`` of a string array, the first of them at
    ``pos`` in ``data``, as far as ``data`` holds their length prefixes.

    A length over ``GGUF_MAX_STRING_LENGTH`` needs no test of its own while ``data`` is
    no longer than that: the next prefix would lie past the end of ``data``. The length
    of the last string read is the one left unchecked, so that string is not counted.

    Args:
        data: the bytes read so far from the file's start (at most
            ``MAX_STRING_BYTES``; longer buffers are refused with ``ValueError``).
        pos: where string ``first`` starts.
        first, stop: the strings to skip.
        byte_order: ``"<"`` or ``">"``.

    Returns:
        ``(i, position)``: string ``i`` (``first <= i <= stop``) starts at ``position``,
        and strings ``first`` to ``i - 1`` each have a valid length; string ``i`` and
        those after it are the careful walk's.
    """
    if len(data) > MAX_STRING_BYTES:
        raise ValueError("skip_strings needs a buffer of at most MAX_STRING_BYTES bytes")
    unpack = _U64[byte_order]
    i = first
    length = 0
    try:
        for i in range(first, stop):  # noqa: B007 (i names the string that stopped the loop)
            (length,) = unpack(data, pos)
            pos += 8 + length
    except (struct.error, OverflowError):
        # the prefix of string i is not in ``data`` (or its position is past any buffer's
        # end): string i - 1, at pos - 8 - length, may be too long
        return (i - 1, pos - 8 - length) if i > first else (i, pos)
    return (stop - 1, pos - 8 - length) if stop > first else (first, pos)


def tensor_infos(
    data: bytearray,
    pos: int,
    first: int,
    stop: int,
    seen: dict[str, Any],
    byte_order: str,
    make: Callable[[str, tuple[int, ...], Any, int, int, int], Any],
    out: list[Any],
) -> tuple[int, int]:
    """Read tensor infos ``first`` to ``stop - 1``, the first of them at ``pos`` in
    ``data``, while each is an ordinary one that lies whole in ``data``.

    Ordinary: a name of at most ``GGML_MAX_NAME - 1`` bytes of UTF-8 without NUL, not in
    ``seen``; 1 to 4 dimensions, each positive; a known ggml type whose block size
    divides ``ne[0]``; an element count and a size in bytes within ``INT64_MAX``. (The
    careful walk accepts more: scalars and zero dimensions.)

    Each info read is ``make(name, ne, ggml_type, offset, nbytes, info_offset)``,
    appended to ``out`` and entered in ``seen`` under its name.

    Returns:
        ``(i, position)``: tensor info ``i`` (``first <= i <= stop``), the first not
        read, starts at ``position``.
    """
    unpack_u64 = _U64[byte_order]
    unpack_u32 = _U32[byte_order]
    end = len(data)
    prod = math.prod
    types = GGML_TYPES
    for i in range(first, stop):
        start = pos
        if pos + 12 > end:
            return i, start
        (n_name,) = unpack_u64(data, pos)
        pos += 8
        if n_name > MAX_NAME_BYTES:
            return i, start
        name_end = pos + n_name
        if name_end + 4 > end:
            return i, start
        try:
            name = data[pos:name_end].decode("utf-8")
        except UnicodeDecodeError:
            return i, start
        if "\0" in name or name in seen:
            return i, start
        (n_dims,) = unpack_u32(data, name_end)
        if not 0 < n_dims <= MAX_DIMS:
            return i, start
        pos = name_end + 4
        if pos + 8 * n_dims + 12 > end:
            return i, start
        values = _SHAPE_TYPE_OFFSET[byte_order, n_dims](data, pos)
        ne = values[:n_dims]
        if min(ne) <= 0 or prod(ne) > INT64_MAX:
            return i, start
        ggml_type = types.get(values[n_dims])
        if ggml_type is None or ne[0] % ggml_type.block_size:
            return i, start
        nbytes = ne[0] // ggml_type.block_size * ggml_type.type_size * prod(ne[1:])
        if nbytes > INT64_MAX:
            return i, start
        pos += 8 * n_dims + 12
        info = make(name, ne, ggml_type, values[n_dims + 1], nbytes, start)
        out.append(info)
        seen[name] = info
    return stop, pos
