"""Find the strings of a GGUF string array in a block of bytes, vectorised with numpy
(what ``gguf.cpp``'s reading of a string array, one ``gguf_reader::read`` per element,
does one string at a time).

A string array is a chain: each element is a u64 byte length followed by that many bytes,
so where element ``i + 1`` starts depends on the length of element ``i``. Walking it one
element at a time is a Python loop per string (262,144 of them for a large vocabulary).
:func:`chain_in_block` finds the chain without one.

Every byte position of the block whose eight bytes could be a valid length (at most
``GGUF_MAX_STRING_LENGTH``: the four high bytes are zero) is a candidate; its successor is
``position + 8 + length``.

In the usual case the length prefixes are exactly the candidates that end a run of
consecutive candidates (the few bytes before a prefix, read with its zero bytes, look like
lengths too; the byte after it is the string's first byte, which is not zero). That set
is taken when each member's successor is the next member, up to one whose successor lies
past the block: the first member is the block's start, each other one the successor of
an element, so each is an element.

Otherwise (empty strings, strings that start with or hold zero bytes) the candidates are
pruned until nothing changes: one is kept only if it is the block's first position or
some kept candidate's successor (it has a predecessor), and its own successor is a kept
candidate or lies past the block. Why the result is exactly the chain: successors lie
strictly after their candidate, so following predecessors back from any kept candidate
ends at the only one exempt from needing one, the first position; every kept candidate
is therefore reached from the first position through successors, that is, it is on the
chain. Conversely a chain element with a valid length is never pruned (its predecessor
and successor are chain elements too). A chain element whose length is invalid is no
candidate, so everything before it is pruned back to the start: the caller then walks
that part one string at a time and reports the error where it is.

The block must lie inside the array (the caller bounds it by 8 bytes per string that
remains), so no element found belongs to what follows the array.
"""

from __future__ import annotations

from typing import Any

from service.loader.gguf.constants import MAX_STRING_BYTES

MAX_ROUNDS = 64
"""Pruning rounds at most; a block still changing after that is left to the caller's
walk (false chains of candidates are short: each round removes one link from each end)."""


def chain_in_block(block: bytes, max_count: int, byte_order: str) -> tuple[int, int]:
    """The elements of a string array that start in ``block``.

    Args:
        block: bytes of the array, starting at an element's length prefix.
        max_count: elements of the array that remain (at most this many are taken).
        byte_order: ``"<"`` or ``">"``, the file's byte order.

    Returns:
        ``(found, end)``: how many consecutive elements from the block's start were
        found, each with a valid length (``0 <= found <= max_count``), and the offset in
        the block just past the last of them (0 when none); ``end`` may lie past the
        block's end (the last element's bytes continue after it).
    """
    import numpy as np

    m = len(block) - 7  # positions with eight bytes after them
    if m <= 0 or max_count <= 0:
        return 0, 0
    buf = np.frombuffer(block, dtype=np.uint8)
    zero = buf == 0
    little = byte_order == "<"
    high = 4 if little else 0  # where the four high bytes of a u64 start
    candidate = zero[high : high + m] & zero[high + 1 : high + 1 + m]
    candidate &= zero[high + 2 : high + 2 + m]
    candidate &= zero[high + 3 : high + 3 + m]
    if not candidate[0]:
        return 0, 0
    # The usual case first: a length prefix is the last of a run of candidates (the
    # bytes before it, read with its zeros, look like small lengths too; the position
    # after it reads the string's first byte among the high bytes). Checked below.
    last = candidate.copy()
    last[:-1] &= ~candidate[1:]
    result = _verified_chain(buf, np.flatnonzero(last), m, max_count, little)
    if result is None:
        result = _pruned_chain(buf, np.flatnonzero(candidate), m, max_count, little)
    return result


def _lengths(buf: Any, positions: Any, little: bool) -> tuple[Any, Any]:
    """The successors of candidate ``positions`` (each position + 8 + the u64 length
    there, whose four high bytes are zero) and whether each length is valid."""
    import numpy as np

    low = 0 if little else 4
    lengths = np.zeros(positions.size, dtype=np.int64)
    for j in range(4):
        lengths |= buf[positions + (low + j)].astype(np.int64) << (8 * j if little else 8 * (3 - j))
    return positions + 8 + lengths, lengths <= MAX_STRING_BYTES


def _verified_chain(buf: Any, cand: Any, m: int, max_count: int, little: bool) -> tuple[int, int] | None:
    """The chain through ``cand`` when each candidate's successor is the next candidate
    until one lies past the block (then every one of them is an element: the first is
    the block's start, each other the successor of an element); ``None`` when a
    successor inside the block is not the next candidate, or a length is invalid."""
    import numpy as np

    if cand.size == 0 or cand[0] != 0:
        return None
    succ, valid = _lengths(buf, cand, little)
    following = np.empty_like(cand)
    following[:-1] = cand[1:]
    following[-1] = -1
    stop = np.flatnonzero(~valid | (succ != following) | (succ >= m))
    j = int(stop[0])  # the last candidate always stops (its "following" is -1)
    if not valid[j] or succ[j] < m:
        return None
    found = min(j + 1, max_count)
    return found, int(succ[found - 1])


def _pruned_chain(buf: Any, cand: Any, m: int, max_count: int, little: bool) -> tuple[int, int]:
    """The chain from the block's start among all candidates, by pruning (see the
    module's docstring); ``(0, 0)`` when it cannot be settled in :data:`MAX_ROUNDS`."""
    import numpy as np

    succ, valid = _lengths(buf, cand, little)
    cand = cand[valid]
    succ = np.minimum(succ[valid], m)  # m: past the block
    for _ in range(MAX_ROUNDS):
        if cand.size == 0 or cand[0] != 0:
            return 0, 0
        member = np.zeros(m + 1, dtype=bool)
        member[cand] = True
        member[m] = True
        has_pred = np.zeros(m + 1, dtype=bool)
        has_pred[succ] = True
        has_pred[0] = True
        keep = member[succ]
        keep &= has_pred[cand]
        if keep.all():
            break
        cand = cand[keep]
        succ = succ[keep]
    else:
        return 0, 0
    if not np.array_equal(succ[:-1], cand[1:]):
        return 0, 0  # not reached: the pruning leaves exactly the chain
    found = min(int(cand.size), max_count)
    if found < cand.size:
        return found, int(cand[found])
    # the last element's successor was clipped to m: compute it again
    end, _ = _lengths(buf, cand[found - 1 : found], little)
    return found, int(end[0])
