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

In the usual case (no string is empty or holds a zero byte, as in a vocabulary) the
length prefixes are exactly the candidates that end a run of consecutive candidates in a
little-endian file (the few bytes before a prefix, read with its zero bytes, look like
lengths too; the byte after it is the string's first byte, which is not zero), and those
that start one in a big-endian file (the byte before a prefix is the previous string's
last one, not zero; the next few positions read its zero bytes). The chain is followed
through that set from the block's start while each member's successor is the next
member: the first member is the block's start, each other one the successor of an
element, so each is an element (:func:`usual_chain`).

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

For :func:`chain_in_block` the block must lie inside the array (the caller bounds it by
8 bytes per string that remains), so no element found belongs to what follows the array;
:func:`usual_chain` takes a block that may run past it.
"""

from __future__ import annotations

from typing import Any

from service.loader.gguf.constants import MAX_STRING_BYTES

MAX_ROUNDS = 64
"""Pruning rounds at most; a block still changing after that is left to the caller's
walk (false chains of candidates are short: each round removes one link from each end)."""


def chain_in_block(block: bytes | memoryview, max_count: int, byte_order: str) -> tuple[int, int]:
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

    scanned = _candidates(block, byte_order)
    if scanned is None or max_count <= 0:
        return 0, 0
    buf, candidate, m, little = scanned
    found, end = _usual_chain(buf, candidate, m, max_count, little)
    if found and (found == max_count or end >= m):
        return found, end
    return _pruned_chain(buf, np.flatnonzero(candidate), m, max_count, little)


def usual_chain(block: bytes | memoryview, max_count: int, byte_order: str) -> tuple[int, int]:
    """The elements of a string array that start in ``block`` and the usual case finds
    (see the module's docstring), up to the first element after which it does not hold.

    Unlike :func:`chain_in_block`, ``block`` may run past the end of the array (into the
    KV pairs or tensor infos that follow): the chain is followed from the block's start
    only, each element's successor checked to be the next prefix found, and at most
    ``max_count`` elements are taken, so nothing after the array is counted.

    Args and returns as :func:`chain_in_block`; ``found`` is 0 when the usual case does
    not hold at the block's start, and may be less than the elements the block holds
    (an empty string, or one that starts with a zero byte, stops it).
    """
    scanned = _candidates(block, byte_order)
    if scanned is None or max_count <= 0:
        return 0, 0
    buf, candidate, m, little = scanned
    return _usual_chain(buf, candidate, m, max_count, little)


def _candidates(block: bytes | memoryview, byte_order: str) -> tuple[Any, Any, int, bool] | None:
    """``(buf, candidate, m, little)``: the block as bytes, whether each of its ``m``
    positions with eight bytes after it holds a valid length (its four high bytes are
    zero), and the byte order; ``None`` when the block's first position is no candidate."""
    import numpy as np

    m = len(block) - 7  # positions with eight bytes after them
    if m <= 0:
        return None
    buf = np.frombuffer(block, dtype=np.uint8)
    zero = buf == 0
    little = byte_order == "<"
    high = 4 if little else 0  # where the four high bytes of a u64 start
    candidate = zero[high : high + m] & zero[high + 1 : high + 1 + m]
    candidate &= zero[high + 2 : high + 2 + m]
    candidate &= zero[high + 3 : high + 3 + m]
    if not candidate[0]:
        return None
    return buf, candidate, m, little


def _usual_chain(buf: Any, candidate: Any, m: int, max_count: int, little: bool) -> tuple[int, int]:
    """The usual case: a length prefix is the last (little-endian) or first (big-endian)
    candidate of its run. The chain is followed through those positions from the
    block's start while each element's successor is the next of them: every element so
    reached is one (the first is the block's start, each other the successor of an
    element), and the last one reached with a valid length is too. Returns
    ``(found, end)`` as :func:`chain_in_block`, ``(0, 0)`` when the block's start is not
    the first of those positions."""
    import numpy as np

    ends = candidate.copy()
    if little:
        ends[:-1] &= ~candidate[1:]
    else:
        ends[1:] &= ~candidate[:-1]
    cand = np.flatnonzero(ends)
    if cand.size == 0 or cand[0] != 0:
        return 0, 0
    succ, valid = _lengths(buf, cand, little)
    following = np.empty_like(cand)
    following[:-1] = cand[1:]
    following[-1] = -1
    j = int(np.argmax(~valid | (succ != following)))  # the last one always stops: following -1
    found = min(j + 1 if valid[j] else j, max_count)
    return (found, int(succ[found - 1])) if found else (0, 0)


def _lengths(buf: Any, positions: Any, little: bool) -> tuple[Any, Any]:
    """The successors of candidate ``positions`` (each position + 8 + the u64 length
    there) and whether each length is valid."""
    import numpy as np

    # every position of the block read as a u64: a view with a stride of one byte
    at = np.ndarray((buf.size - 7,), dtype="<u8" if little else ">u8", buffer=buf, strides=(1,))
    lengths = at[positions].astype(np.int64)
    return positions + 8 + lengths, lengths <= MAX_STRING_BYTES


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
