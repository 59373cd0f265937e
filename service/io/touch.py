"""Faulting in a buffer's pages ahead of a sequential writer, on a helper thread, so that
page faults (zeroing fresh pages) overlap the reads that fill the buffer."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from service.io import libc
from service.io.align import (
    BACKGROUND_TOUCH_MIN,
    HUGE_PAGE_SIZE,
    HUGE_PAGES,
    LARGE_BUFFER,
    MADV_POPULATE_WRITE,
    PAGE_SIZE,
    align_down,
    align_up,
    aligned_empty,
    first_touch_policy,
)

TOUCH_EXTENT = 8 << 20
"""Bytes faulted in per ``MADV_POPULATE_WRITE`` call of the helper thread."""

TOUCH_LEAD = 64 << 20
"""How far ahead of the writer's position the helper faults pages in, in bytes."""


def prefault(view: np.ndarray[Any, Any]) -> bool:
    """Fault in the whole pages inside ``view`` for writing now (``MADV_POPULATE_WRITE``,
    Linux 5.14+). Returns False where the kernel cannot (older kernels, a range that is
    not mapped writable); the pages then fault in as they are written."""
    start = align_up(view.ctypes.data, PAGE_SIZE)
    end = align_down(view.ctypes.data + view.nbytes, PAGE_SIZE)
    if end <= start:
        return True
    try:
        libc.madvise(start, end - start, MADV_POPULATE_WRITE)
    except OSError:
        return False
    return True


class TouchAhead:
    """Faults in ``array``'s pages on a helper thread, staying up to ``lead`` bytes ahead
    of the position the writer reports with :meth:`advance`; pages the writer reaches
    first fault in as it writes them (the helper skips past them).

    The helper holds a reference to ``array`` until it stops, so the memory cannot be
    freed under it. Use as a context manager, or call :meth:`close`.

    Args:
        array: the buffer (written front to back).
        extent: bytes per populate call.
        lead: bytes faulted in ahead of the writer.
    """

    def __init__(self, array: np.ndarray[Any, Any], *, extent: int = TOUCH_EXTENT, lead: int = TOUCH_LEAD) -> None:
        self._array: np.ndarray[Any, Any] | None = array
        self._extent = max(extent, PAGE_SIZE)
        self._lead = max(lead, self._extent)
        self._writer = 0
        self._cursor = 0
        self._stop = False
        self._cond = threading.Condition()
        self.touched = 0
        """Bytes the helper faulted in (for measurement)."""
        self._thread = threading.Thread(target=self._run, name="hoist-touch", daemon=True)
        self._thread.start()

    def advance(self, position: int) -> None:
        """The writer is about to write up to byte ``position`` of the buffer."""
        with self._cond:
            if position > self._writer:
                self._writer = position
                self._cond.notify()

    def _run(self) -> None:
        array = self._array
        assert array is not None
        size = array.nbytes
        while True:
            with self._cond:
                while not self._stop and self._cursor >= min(self._writer + self._lead, size):
                    self._cond.wait()
                if self._stop:
                    break
                lo = max(self._cursor, self._writer)
                hi = min(lo + self._extent, self._writer + self._lead, size)
                self._cursor = hi
            if hi > lo:
                if not prefault(array[lo:hi]):
                    break
                self.touched += hi - lo
            if hi >= size:
                break
        self._array = None

    def close(self) -> None:
        """Stop the helper and wait for it (it finishes the extent in progress)."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join()
        self._array = None

    def __enter__(self) -> TouchAhead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def host_array(nbytes: int) -> tuple[np.ndarray[tuple[int], np.dtype[np.uint8]], TouchAhead | None]:
    """A fresh host buffer of ``nbytes`` bytes, 4096-byte aligned, placed and first
    touched as the host buffer policy says (:data:`~service.io.align.HUGE_PAGES`,
    :func:`~service.io.align.first_touch_policy`, for buffers of at least
    :data:`~service.io.align.LARGE_BUFFER` bytes).

    Returns the array and, under the ``background`` policy for buffers of at least
    :data:`~service.io.align.BACKGROUND_TOUCH_MIN` bytes, the helper faulting its pages
    in, ahead of the position the reads report (:meth:`TouchAhead.advance`; it starts at
    the buffer's start and has no limit on its lead); the owner closes the helper before
    it frees the array.
    """
    if nbytes < LARGE_BUFFER:
        return aligned_empty(nbytes), None
    policy = first_touch_policy()
    if policy == "background" and nbytes < BACKGROUND_TOUCH_MIN:
        policy = "on-read"
    array = aligned_empty(
        nbytes,
        HUGE_PAGE_SIZE if HUGE_PAGES else PAGE_SIZE,
        populate=policy == "populate",
        huge=True if HUGE_PAGES else None,
    )
    return array, TouchAhead(array, lead=nbytes) if policy == "background" else None
