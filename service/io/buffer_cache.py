"""Keeping freed large host buffers, pages already touched, for the next load that
allocates one of the same size: refilling touched memory skips the page faults (and the
zeroing of fresh pages) that dominate a load into fresh memory.

Measured (bench/memory.py ``reuse`` part, 2.1 GiB): refilling a touched buffer 0.92 s,
a fresh one 2.48 s. A load -> unload -> load of the 2.1 GiB synthetic model in one
process (bench/memory.py ``cycle`` part, host ``none``, medians of 5, 2 busy shared
cores): the second load 1.35 s without, 0.84 s with the cache (x1.62) warm; cold,
2.85 s against 2.81 s (disk bound: no gain, no loss). Buffers are kept per size class
(the size rounded up to whole pages:
a class holds buffers of that exact page-rounded size, so nothing is wasted on a tail),
least recently freed dropped first, within a byte cap; all are dropped after a while
without allocations, when the host's free memory runs low, or when an allocation that
finds none of its size needs their memory.

A kept buffer is memory the process holds: its bytes stay counted in
:data:`~service.io.meter.HOST_MEMORY` until it is dropped, so that admission counts it
as hoist's, reclaimable (capacity = free + held), like the buffers of a resident model.
A buffer handed out again still holds the bytes of the load before it; every tensor
byte is read over them, and nothing reads a host buffer outside its tensors.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeAlias

from service.io.align import PAGE_SIZE, align_up
from service.io.meter import HOST_MEMORY, MemoryMeter

if TYPE_CHECKING:  # numpy is imported with the first buffer, not with the devices
    import numpy as np

IDLE_RELEASE_S = 60.0
"""Kept buffers are dropped when no host buffer was allocated or freed for this long."""

LOW_MEMORY_FRACTION = 8
"""Kept buffers are dropped (and no more kept) while the host's free memory is below
1/N of its total."""

HostArray: TypeAlias = "np.ndarray[tuple[int], np.dtype[np.uint8]]"


def size_class(nbytes: int) -> int:
    """The class of a buffer of ``nbytes`` bytes: ``nbytes`` rounded up to whole pages."""
    return align_up(nbytes, PAGE_SIZE)


class HostBufferCache:
    """Freed host buffers kept for reuse, at most ``cap`` bytes in all.

    Args:
        cap: most bytes kept (0: none kept).
        memory: the host's (free, total) memory in bytes now (for the low-memory rule).
        idle_s: drop everything after this many seconds without :meth:`take` or
            :meth:`put` (0: never).
        meter: where kept bytes are counted as held.
    """

    def __init__(
        self,
        cap: int = 0,
        *,
        memory: Callable[[], tuple[int, int]] | None = None,
        idle_s: float = IDLE_RELEASE_S,
        meter: MemoryMeter = HOST_MEMORY,
    ) -> None:
        if cap < 0:
            raise ValueError(f"host buffer cache cap is {cap} bytes, it must be >= 0")
        self.cap = cap
        self.idle_s = idle_s
        self._memory = memory
        self._meter = meter
        self._lock = threading.Lock()
        self._kept: OrderedDict[int, HostArray] = OrderedDict()  # id -> array, oldest first
        self._nbytes = 0
        self._timer: threading.Timer | None = None
        self._last_use = time.monotonic()
        self.hits = 0
        """Buffers handed out again (for measurement)."""

    @property
    def nbytes(self) -> int:
        """Bytes kept now."""
        return self._nbytes

    def configure(self, cap: int, *, idle_s: float | None = None) -> None:
        """Set the byte cap (dropping what no longer fits) and the idle time."""
        if cap < 0:
            raise ValueError(f"host buffer cache cap is {cap} bytes, it must be >= 0")
        with self._lock:
            self.cap = cap
            if idle_s is not None:
                self.idle_s = idle_s
            dropped = self._shrink_to(cap)
        del dropped

    def take(self, nbytes: int) -> HostArray | None:
        """A kept buffer of ``nbytes``' size class (whole: :func:`size_class` bytes,
        holding whatever was last written there), removed from the cache; None when none
        is kept.
        On a miss while the host is short of ``nbytes`` free bytes, everything kept is
        dropped first, so that the allocation that follows gets that memory back."""
        key = size_class(nbytes)
        dropped: list[HostArray] = []
        with self._lock:
            self._touch()
            for ident, array in reversed(self._kept.items()):  # newest first: likeliest resident
                if array.nbytes == key:
                    del self._kept[ident]
                    self._count(-array.nbytes)
                    self.hits += 1
                    return array
            if self._kept and self._memory is not None and self._memory()[0] < nbytes:
                dropped = self._shrink_to(0)
        del dropped
        return None

    def put(self, array: HostArray) -> bool:
        """Keep ``array`` (a whole buffer of a size class, no longer used by anyone) for
        reuse; False when it is not kept (the cache is off, it exceeds the cap, or the
        host is low on memory: then everything kept is dropped too). Older buffers are
        dropped to make room."""
        n = array.nbytes
        dropped: list[HostArray] = []
        with self._lock:
            self._touch()
            low = self._low_memory()
            if n > self.cap or n != size_class(n) or low:
                dropped = self._shrink_to(0 if low else self.cap)
                return False
            dropped = self._shrink_to(self.cap - n)
            self._kept[id(array)] = array
            self._count(n)
            self._arm()
        del dropped
        return True

    def clear(self) -> int:
        """Drop every kept buffer; returns the bytes dropped."""
        with self._lock:
            dropped = self._shrink_to(0)
        n = sum(a.nbytes for a in dropped)
        del dropped
        return n

    def release_if_idle(self) -> int:
        """Drop everything if nothing was taken or put for :attr:`idle_s`; returns the
        bytes dropped."""
        with self._lock:
            idle = self.idle_s > 0 and time.monotonic() - self._last_use >= self.idle_s
            dropped = self._shrink_to(0) if idle else []
        n = sum(a.nbytes for a in dropped)
        del dropped
        return n

    # -- under the lock ------------------------------------------------------------------------

    def _count(self, n: int) -> None:
        self._nbytes += n
        self._meter.add(n)

    def _shrink_to(self, limit: int) -> list[HostArray]:
        """Remove the oldest buffers until at most ``limit`` bytes are kept; returns them
        (the caller lets them go outside the lock: freeing 2 GiB takes a while)."""
        out = []
        while self._kept and self._nbytes > max(limit, 0):
            _, array = self._kept.popitem(last=False)
            self._count(-array.nbytes)
            out.append(array)
        return out

    def _low_memory(self) -> bool:
        if self._memory is None:
            return False
        free, total = self._memory()
        return total > 0 and free < total // LOW_MEMORY_FRACTION

    def _touch(self) -> None:
        self._last_use = time.monotonic()

    def _arm(self) -> None:
        """Start the idle timer if it is not running (it re-arms itself while in use)."""
        if self._timer is not None or self.idle_s <= 0:
            return
        self._timer = threading.Timer(self.idle_s, self._on_timer)
        self._timer.daemon = True
        self._timer.start()

    def _on_timer(self) -> None:
        with self._lock:
            self._timer = None
            wait = self.idle_s - (time.monotonic() - self._last_use)
            if self._kept and wait > 0:
                self._timer = threading.Timer(wait, self._on_timer)
                self._timer.daemon = True
                self._timer.start()
                return
        self.release_if_idle()


def _host_memory() -> tuple[int, int]:
    from service.loader.devices.cpu import host_memory

    mem = host_memory()
    return mem.free, mem.total


HOST_BUFFER_CACHE = HostBufferCache(0, memory=_host_memory)
"""The process's cache of freed large host buffers; off (cap 0) until the service sets
its cap (``HOIST_HOST_BUFFER_CACHE_BYTES``)."""
