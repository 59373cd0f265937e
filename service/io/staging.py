"""A pool of staging buffers used in rotation, with event-based backpressure
(llama.cpp's four pinned upload buffers and their events in ``load_all_data``).

The reader fills buffer *i*, queues work that reads from it (an upload, a validation)
and records that work's completion on the buffer; before filling buffer *i* again it
waits for everything recorded on it. A device that falls behind therefore stalls the
reader, and no more than ``N`` buffers are ever in flight.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar


class Waitable(Protocol):
    """Something that completes: a device event, a future."""

    def synchronize(self) -> None: ...

    def query(self) -> bool: ...


class FutureWaitable:
    """A :class:`concurrent.futures.Future` as a :class:`Waitable`."""

    def __init__(self, future: Future[Any]) -> None:
        self.future = future

    def synchronize(self) -> None:
        self.future.result()

    def query(self) -> bool:
        return self.future.done()

    def wait(self, timeout: float) -> bool:
        """Block until done or ``timeout`` seconds passed; True when done."""
        return not futures_wait([self.future], timeout).not_done


@dataclass(frozen=True, slots=True)
class PoolStats:
    """Figures of a pool.

    Attributes:
        buffers: buffers in the pool.
        in_flight: buffers whose recorded work has not completed now.
        peak_in_flight: the most buffers ever in flight at once.
        waits: times the reader had to wait for a buffer's work (backpressure).
        wait_seconds: total time spent waiting, in seconds.
    """

    buffers: int
    in_flight: int
    peak_in_flight: int
    waits: int
    wait_seconds: float


B = TypeVar("B")


class StagingPool(Generic[B]):
    """``N`` buffers handed out in rotation.

    Args:
        buffers: the staging buffers (owned by the caller, who frees them after
            :meth:`drain`).

    SAFETY: a buffer returned by :meth:`acquire` may be written until work reading it is
    recorded with :meth:`record`; after that it must not be written until it is acquired
    again.
    """

    def __init__(self, buffers: Sequence[B]) -> None:
        if not buffers:
            raise ValueError("a staging pool needs at least one buffer")
        self.buffers = list(buffers)
        self._pending: list[list[Waitable]] = [[] for _ in self.buffers]
        self._next = 0
        self._peak = 0
        self._waits = 0
        self._wait_seconds = 0.0
        self._lock = threading.Lock()

    def _in_flight(self) -> int:
        return sum(1 for pending in self._pending if any(not w.query() for w in pending))

    def acquire(self, timeout: float | None = None) -> tuple[int, B]:
        """The next buffer in rotation, after everything recorded on it has completed
        (errors of that work are raised here). Returns ``(index, buffer)``.

        Args:
            timeout: the most seconds to wait for the buffer's work (None: no limit).

        Raises:
            TimeoutError: the work is still running after ``timeout`` seconds; the
                rotation stays where it was, so the next call asks for the same buffer.
        """
        i = self._next
        pending = self._pending[i]
        if pending:
            busy = any(not w.query() for w in pending)
            started = time.perf_counter()
            try:
                if busy and timeout is not None:
                    self._wait(pending, started + timeout)
                for w in pending:
                    w.synchronize()
            except TimeoutError:
                self._wait_seconds += time.perf_counter() - started
                raise
            except BaseException:
                pending.clear()
                raise
            pending.clear()
            if busy:
                self._waits += 1
                self._wait_seconds += time.perf_counter() - started
        self._next = (i + 1) % len(self.buffers)
        return i, self.buffers[i]

    @staticmethod
    def _wait(pending: list[Waitable], deadline: float) -> None:
        """Wait until all of ``pending`` completed; TimeoutError after ``deadline``.

        Work that can be waited for with a timeout (a ``wait(seconds) -> bool`` method:
        emulated devices' events, futures) wakes the caller as it completes; other work
        (a CUDA event) is polled, at growing intervals up to 1 ms."""
        pause = 2e-5
        for w in pending:
            wait = getattr(w, "wait", None)
            while not w.query():
                now = time.perf_counter()
                if now >= deadline:
                    raise TimeoutError("staging buffer still in use")
                if wait is not None:
                    wait(deadline - now)
                else:
                    time.sleep(min(pause, deadline - now))
                    pause = min(pause * 2, 1e-3)

    def record(self, index: int, *work: Waitable) -> None:
        """Record work that reads buffer ``index``; it is reused only after ``work``."""
        self._pending[index].extend(work)
        with self._lock:
            self._peak = max(self._peak, self._in_flight())

    def drain(self) -> None:
        """Wait for all recorded work; raises the first error among it, after waiting
        for the rest."""
        first: BaseException | None = None
        for pending in self._pending:
            for w in pending:
                try:
                    w.synchronize()
                except BaseException as exc:
                    first = first or exc
            pending.clear()
        if first is not None:
            raise first

    def stats(self) -> PoolStats:
        """Current figures."""
        return PoolStats(len(self.buffers), self._in_flight(), self._peak, self._waits, self._wait_seconds)
