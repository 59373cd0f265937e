"""Uploaders: per device, its stream and its staging buffers (of its host buffer type) in
a :class:`~service.io.staging.StagingPool`, and the upload stage's timing: from the
completion times the stream stamps on its events, or else by a thread that follows the
stream's completions.

A staging buffer is acquired (waiting, with a timeout, for the work recorded on it: the
backpressure that bounds the buffers in flight), filled by a reader, then handed to the
stream; it is released to the pool by the upload's event (and those of the validations
reading it).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable

from service.io.staging import PoolStats, StagingPool, Waitable
from service.loader.devices import Device, DeviceBuffer, Event, Stream
from service.loader.pipeline.stats import StageClock

ACQUIRE_POLL_SECONDS = 0.05
"""How often a reader waiting for a staging buffer checks whether the load was cancelled."""


class Uploader:
    """A device's staged uploads.

    Args:
        device: the device (it can stage: async copies, events, a host buffer type).
        count: staging buffers.
        nbytes: bytes of each, before the room kept to align its start.
        alignment: the start of each buffer's usable part is aligned to this.
        clock: the upload stage's clock.

    Raises (constructor):
        OutOfMemoryError: a staging buffer cannot be allocated.
        RuntimeError: the device gives no stream.
    """

    def __init__(self, device: Device, count: int, nbytes: int, alignment: int, clock: StageClock) -> None:
        assert device.host_buffer_type is not None
        self.device = device
        self.clock = clock
        self.buffers: list[DeviceBuffer] = []
        self.shifts: list[int] = []
        self.stream: Stream | None = None
        self._done: queue.SimpleQueue[tuple[Event, float, int] | None] = queue.SimpleQueue()
        self._timer: threading.Thread | None = None
        self._stamped: deque[tuple[Event, float, int]] = deque()
        self._last = 0.0
        try:
            for _ in range(count):
                buf = device.alloc(device.host_buffer_type, nbytes + alignment)
                self.buffers.append(buf)
                addr = int(buf.view(0, 1).ctypes.data)
                self.shifts.append((-addr) % alignment)
            self.stream = device.open_stream()
            if self.stream is None:
                raise RuntimeError(f"{device.name} has no stream for staged uploads")
        except BaseException:
            self.close(abort=True)
            raise
        self.pool: StagingPool[DeviceBuffer] = StagingPool(self.buffers)
        if not self.stream.stamps_events:
            self._timer = threading.Thread(target=self._time_uploads, name=f"hoist-{device.name}-uploads", daemon=True)
            self._timer.start()

    def _time_uploads(self) -> None:
        """Follow the stream's events in order (streams that do not stamp them)."""
        while True:
            item = self._done.get()
            if item is None:
                return
            event, queued, nbytes = item
            try:
                event.synchronize()
            except BaseException:  # raised to the loader through the pool
                pass
            self._count(queued, time.perf_counter(), nbytes)

    def _count(self, queued: float, done: float, nbytes: int) -> None:
        """An upload queued at ``queued`` completed at ``done``: it was busy from then, or
        from when the one before it completed (the stream runs them in order)."""
        self.clock.add(done - max(queued, self._last), nbytes)
        self._last = done

    def _count_stamped(self) -> None:
        """Time the uploads completed so far, in order, from their events' stamps."""
        while self._stamped and self._stamped[0][0].done_at is not None:
            event, queued, nbytes = self._stamped.popleft()
            assert event.done_at is not None
            self._count(queued, event.done_at, nbytes)

    def acquire(self, cancelled: Callable[[], bool]) -> tuple[int, DeviceBuffer, int] | None:
        """The next staging buffer once its recorded work is done: ``(slot, buffer,
        offset of its aligned start)``; None when the load is cancelled meanwhile."""
        while True:
            try:
                slot, buf = self.pool.acquire(timeout=ACQUIRE_POLL_SECONDS)
            except TimeoutError:
                if cancelled():
                    return None
                continue
            return slot, buf, self.shifts[slot]

    def upload(
        self, slot: int, dest: DeviceBuffer, dest_offset: int, src_offset: int, nbytes: int, *also: Waitable
    ) -> None:
        """Queue the copy of ``nbytes`` at ``src_offset`` of staging buffer ``slot`` to
        ``dest``; the buffer is reused once the copy and ``also`` (validations reading
        it) are done."""
        assert self.stream is not None
        event = self.stream.upload(dest, dest_offset, self.buffers[slot], src_offset, nbytes)
        if self._timer is None:
            self._count_stamped()
            self._stamped.append((event, time.perf_counter(), nbytes))
        else:
            self._done.put((event, time.perf_counter(), nbytes))
        self.pool.record(slot, event, *also)

    def drain(self) -> None:
        """Wait for every queued upload; raises the first error among them."""
        self.pool.drain()

    def stats(self) -> PoolStats:
        """The staging pool's figures."""
        return self.pool.stats()

    def close(self, *, abort: bool) -> None:
        """Drop copies not started yet when ``abort``; wait for the rest, close the
        stream and free the staging buffers. Idempotent."""
        if self.stream is not None:
            if abort:
                self.stream.abort()
            self.stream.close()
            self.stream = None
        if self._timer is not None:
            self._done.put(None)
            self._timer.join()
            self._timer = None
        self._count_stamped()
        self._stamped.clear()  # dropped copies (a failed stream) have no stamp
        for buf in self.buffers:
            buf.free()
        self.buffers = []
