"""Locking memory in RAM (llama.cpp's ``llama_mlock``): a region whose locked prefix
grows as a load proceeds, with a clear warning, not an error, when the lock limit
(``RLIMIT_MEMLOCK``) is too low."""

from __future__ import annotations

import errno
import os
import resource

from service.io import libc
from service.io.align import PAGE_SIZE, align_down, align_up
from service.io.meter import MemoryMeter


def memlock_limit() -> int | None:
    """The soft ``RLIMIT_MEMLOCK`` in bytes, or None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


class MemoryLock:
    """Locks ``[addr, addr + n)`` for a growing ``n``.

    Args:
        addr: start of the region (any address; locking works on whole pages).
        what: a name for messages (a file or buffer).
        meter: counts the bytes locked (for a locked file mapping, whose pages are not
            counted as an allocation anywhere else).
        on_fault: lock pages as they are first faulted in (``MLOCK_ONFAULT``) instead of
            faulting the whole range in when it is locked: for a buffer about to be
            filled by reads, whose pages then fault in once, during the read, rather
            than once for the lock and then again written over. Falls back to a plain
            lock where ``mlock2`` is missing.

    Attributes:
        locked: bytes locked so far, from ``addr``.
        failed: the warning given when locking failed; further growth is not attempted.
    """

    def __init__(self, addr: int, what: str, meter: MemoryMeter | None = None, *, on_fault: bool = False) -> None:
        self.addr = addr
        self.on_fault = on_fault
        self.what = what
        self.meter = meter
        self.locked = 0
        self.failed: str | None = None
        self._page_start = align_down(addr, PAGE_SIZE)
        self._prelocked = 0

    def prelock(self, target: int) -> bool:
        """Lock ``[addr, addr + target)`` on fault now, in one call (``MLOCK_ONFAULT``):
        pages are locked as they are faulted in, and :meth:`grow_to` up to ``target``
        then only counts them, with no call each time (every ``mlock`` call first
        drains the page lists of every CPU, which waits for the others). Returns False,
        with nothing locked, where the kernel refuses (the lock limit is checked for
        the whole range at once): :meth:`grow_to` then locks step by step, as far as the
        limit allows, and warns."""
        end = align_up(self.addr + target, PAGE_SIZE)
        if self.locked or self._prelocked or end <= self._page_start:
            return False
        try:
            libc.mlock_on_fault(self._page_start, end - self._page_start)
        except OSError:
            return False
        self._prelocked = target
        return True

    def covers(self, target: int) -> bool:
        """:meth:`prelock` already took ``[addr, addr + target)``."""
        return target <= self._prelocked

    def drop_prelock(self) -> None:
        """Undo :meth:`prelock` while nothing is counted as locked yet: the pages faulted
        in meanwhile are unlocked."""
        if self._prelocked and not self.locked:
            self._unlock(self._prelocked)
            self._prelocked = 0

    def grow_to(self, target: int) -> str | None:
        """Lock up to ``addr + target``. Returns a warning (and stops trying) when the
        kernel refuses, naming the bytes locked so far and the limit needed; the caller
        reports it (the load's warnings), so it is not logged here."""
        if self.failed is not None or target <= self.locked:
            return None
        if self.covers(target):
            if self.meter is not None:
                self.meter.add(target - self.locked)
            self.locked = target
            return None
        start = align_up(self.addr + self.locked, PAGE_SIZE) if self.locked else self._page_start
        end = align_up(self.addr + target, PAGE_SIZE)
        if end > start:
            try:
                self._lock(start, end - start)
            except OSError as exc:
                limit = memlock_limit()
                need = align_up(self.addr + target, PAGE_SIZE) - self._page_start
                self.failed = (
                    f"failed to mlock {end - start}-byte buffer of {self.what} (after previously locking "
                    f"{self.locked} bytes): {os.strerror(exc.errno or 0)}; RLIMIT_MEMLOCK is "
                    f"{'unlimited' if limit is None else f'{limit} bytes'}, {need} bytes are needed: "
                    "try increasing it ('ulimit -l' as root, or the container's memlock ulimit)"
                )
                return self.failed
        if self.meter is not None:
            self.meter.add(target - self.locked)
        self.locked = target
        return None

    def _lock(self, start: int, length: int) -> None:
        if self.on_fault:
            try:
                libc.mlock_on_fault(start, length)
                return
            except OSError as exc:
                if exc.errno not in (errno.ENOSYS, errno.EINVAL):
                    raise
                self.on_fault = False
        libc.mlock(start, length)

    def _unlock(self, upto: int) -> None:
        """Unlock the pages from the region's start to ``addr + upto``."""
        end = align_up(self.addr + upto, PAGE_SIZE)
        try:
            libc.munlock(self._page_start, end - self._page_start)
        except OSError:
            pass  # already unmapped: the lock went with the pages

    def release(self) -> None:
        """Unlock what was locked. Idempotent."""
        if self.locked or self._prelocked:
            self._unlock(max(self.locked, self._prelocked))
            if self.meter is not None:
                self.meter.add(-self.locked)
        self.locked = self._prelocked = 0
