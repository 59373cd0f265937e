"""Alignment arithmetic and aligned host buffers."""

from __future__ import annotations

import mmap
import os
from typing import TYPE_CHECKING, Any, Literal

from service.io import libc

if TYPE_CHECKING:  # imported by the first buffer: the arithmetic here is needed without it
    import numpy as np


def align_up(value: int, alignment: int) -> int:
    """``value`` rounded up to a multiple of ``alignment`` (a power of two)."""
    return (value + alignment - 1) & ~(alignment - 1)


def align_down(value: int, alignment: int) -> int:
    """``value`` rounded down to a multiple of ``alignment`` (a power of two)."""
    return value & ~(alignment - 1)


PAGE_SIZE = mmap.PAGESIZE
"""The host's page size in bytes."""


MADV_POPULATE_WRITE = 23
"""Linux 5.14+: fault in a range's pages for writing, in the kernel."""

_POPULATE_MIN = 1 << 20


def populate_write(array: np.ndarray[Any, Any]) -> None:
    """Fault in the pages of a large, about-to-be-written array at once (in the kernel,
    much cheaper than one fault per page as the data arrives). Best effort: nothing
    happens on kernels without ``MADV_POPULATE_WRITE`` or for small arrays."""
    if array.nbytes < _POPULATE_MIN:
        return
    start = align_up(array.ctypes.data, PAGE_SIZE)
    end = align_down(array.ctypes.data + array.nbytes, PAGE_SIZE)
    if end > start:
        try:
            libc.madvise(start, end - start, MADV_POPULATE_WRITE)
        except OSError:
            pass


HUGE_PAGE_SIZE = 2 << 20
"""The size of a transparent huge page on x86-64 and arm64 (4 KiB base pages)."""


def advise_huge(array: np.ndarray[Any, Any], huge: bool = True) -> bool:
    """``MADV_HUGEPAGE`` (or, ``huge`` False, ``MADV_NOHUGEPAGE``) over the whole huge
    pages inside ``array``: with THP in ``madvise`` mode the kernel backs them with 2 MiB
    pages where it can, or never. (numpy already advises huge pages on its own arrays of
    4 MiB and more.) Returns False where the kernel refuses."""
    start = align_up(array.ctypes.data, HUGE_PAGE_SIZE)
    end = align_down(array.ctypes.data + array.nbytes, HUGE_PAGE_SIZE)
    if end <= start:
        return False
    try:
        libc.madvise(start, end - start, mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
    except (OSError, AttributeError):
        return False
    return True


def aligned_empty(
    nbytes: int, alignment: int = 4096, *, populate: bool = False, huge: bool | None = None
) -> np.ndarray[tuple[int], np.dtype[np.uint8]]:
    """An uninitialised host buffer of ``nbytes`` bytes whose start address is a multiple
    of ``alignment`` (a power of two; 4096 suits O_DIRECT on every common filesystem).

    Args:
        populate: fault its pages in now when it is large (:func:`populate_write`).
        huge: advise huge pages over it, or (False) no huge pages (:func:`advise_huge`,
            before any page is touched); None leaves numpy's own advice.

    The array owns its memory (through its base); it is freed when the last view of it
    goes away.
    """
    import numpy as np

    raw = np.empty(nbytes + alignment, dtype=np.uint8)  # fresh pages, untouched
    shift = (-raw.ctypes.data) % alignment
    out = raw[shift : shift + nbytes]
    if huge is not None:
        advise_huge(out, huge)
    if populate:
        populate_write(out)
    return out


# -- host buffer policy, chosen by bench/memory.py ---------------------------------------------

LARGE_BUFFER = 64 << 20
"""Host buffers of at least this many bytes get the huge-page and first-touch policies
below; smaller ones are plain (their first touch costs little)."""

HUGE_PAGES = True
"""Large host buffers start on a 2 MiB boundary and are advised ``MADV_HUGEPAGE``.

Measured (bench/memory.py, 2.1 GiB of tensor data read in 16 MiB chunks into a fresh
buffer, THP ``madvise``, 2 shared cores): with huge pages 0.70 s against 0.72 s with
touch-ahead, 1.13 s against 1.19 s reading into untouched memory on a quiet machine, and
2.07 s against 4.00 s under load (medians of 3-7); cold, 2.32 s against 2.72 s. 4 KiB
pages cost one fault and one page-table entry per page; a 2 MiB page, one of each per
512. (numpy advises huge pages on its own large arrays already; this makes the choice
explicit and aligns the buffer so its first and last 2 MiB can be huge pages too.)"""

FirstTouch = Literal["populate", "on-read", "background"]

FIRST_TOUCH: FirstTouch = "background"
"""How the pages of a large, fresh host buffer are first touched:

- ``populate``: all at once at allocation (``MADV_POPULATE_WRITE``), before any byte is
  read: the reads wait for the whole buffer to be zeroed;
- ``on-read``: by the reads that fill it (each page faults in as ``read()`` copies into
  it, while the kernel's read-ahead runs);
- ``background``: by a helper thread started at allocation (:class:`~service.io.touch.
  TouchAhead`) while the reads fill the buffer from its start: zeroing pages overlaps
  copying data on a second core.

Measured with huge pages (bench/memory.py, 2.1 GiB, medians): warm page cache on a
quiet machine, populate 1.21 s, on-read 1.13 s, background 0.71 s (x1.7 against on-read,
x2.0 against populate, the old policy); cold, populate 2.45 s, on-read 2.05 s,
background/touch-ahead 1.94-2.25 s (disk bound). With both cores busy with other work,
the helper has no core to run on and on-read was faster (2.07 s against 2.91 s); one
usable CPU therefore falls back to ``on-read`` (:func:`first_touch_policy`).

The helper follows the reads: the loader tells it where they have reached as it issues
each extent (:meth:`~service.io.touch.TouchAhead.advance`), so it skips the pages the
reads fault in themselves and works ahead of them, instead of racing them over the same
pages from the buffer's start. Measured in one process on the 2.1 GiB synthetic model
(host loads, 2 busy shared cores, medians of 5 interleaved, paired ratios): warm ``none``
2.61 s racing from the start, 2.05 s following the reads (x1.38), 2.36 s on-read, 2.65 s
prefaulting the next extent on the loader thread instead; warm ``mlock`` 2.56 / 2.04 /
2.18 / 2.98 s; cold ``none`` 3.49 / 3.43 / 3.61 / 3.82 s; cold ``mlock`` 3.47 / 2.57 /
3.31 / 3.25 s; the helper following the reads also took the least CPU time (1.5-1.9 s
against 1.95-2.35 s). Buffers under :data:`BACKGROUND_TOUCH_MIN` are touched on read."""

BACKGROUND_TOUCH_MIN = 512 << 20
"""Host buffers smaller than this are touched ``on-read`` even under the ``background``
policy: the helper thread costs more than it overlaps. Measured on the gemma3 sample
(253 MB file; fresh processes, medians of 9 interleaved, 2 busy shared cores): warm
``none`` 300 ms with the helper against 229 ms without (paired x1.39), warm ``mlock``
218 ms both (paired x1.11 without), cold ``none``/``mlock`` 472/463 ms with against
457/478 ms without; on 2.1 GiB the helper wins (above). The threshold lies between the
two sizes measured."""


def first_touch_policy() -> FirstTouch:
    """:data:`FIRST_TOUCH`, or ``on-read`` in place of ``background`` where this process
    may run on a single CPU (no core for the helper thread)."""
    if FIRST_TOUCH == "background":
        try:
            cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = os.cpu_count() or 1
        if cpus < 2:
            return "on-read"
    return FIRST_TOUCH
