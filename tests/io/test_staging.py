"""The staging pool: rotation, backpressure, bounded buffers in flight, errors."""

from __future__ import annotations

import threading
import time

import pytest

from service.io.staging import StagingPool


class Slow:
    """Work that completes after ``seconds`` (or fails)."""

    def __init__(self, seconds: float, error: Exception | None = None) -> None:
        self.error = error
        self._done = threading.Event()
        threading.Timer(seconds, self._done.set).start()

    def synchronize(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise self.error

    def query(self) -> bool:
        return self._done.is_set()


@pytest.mark.parametrize("n", [1, 2, 4])
def test_rotation_and_backpressure(n: int) -> None:
    pool = StagingPool([f"buf{i}" for i in range(n)])
    order = []
    started = time.perf_counter()
    for _ in range(3 * n):
        i, buf = pool.acquire()
        order.append(buf)
        pool.record(i, Slow(0.02))
    pool.drain()
    elapsed = time.perf_counter() - started
    assert order == [f"buf{i % n}" for i in range(3 * n)]
    stats = pool.stats()
    assert stats.peak_in_flight <= n and stats.peak_in_flight >= 1
    assert stats.waits >= 1  # a reuse found its buffer still busy and waited
    assert elapsed >= 3 * 0.02 * 0.9  # three rounds of slow work were waited for
    assert stats.in_flight == 0


def test_errors_surface_on_reuse_and_drain() -> None:
    pool = StagingPool(["a"])
    i, _ = pool.acquire()
    pool.record(i, Slow(0.0, RuntimeError("upload failed")))
    with pytest.raises(RuntimeError, match="upload failed"):
        pool.acquire()
    i, _ = pool.acquire()
    pool.record(i, Slow(0.0, RuntimeError("late")))
    with pytest.raises(RuntimeError, match="late"):
        pool.drain()


def test_empty_pool_is_refused() -> None:
    with pytest.raises(ValueError):
        StagingPool([])


def test_acquire_times_out_and_keeps_its_place() -> None:
    pool = StagingPool(["a", "b"])
    first, _ = pool.acquire()
    pool.record(first, Slow(0.3))
    second, _ = pool.acquire()
    assert second != first
    started = time.perf_counter()
    with pytest.raises(TimeoutError):
        pool.acquire(timeout=0.02)  # buffer "a" is still being read by its slow work
    assert time.perf_counter() - started < 0.25
    # the rotation did not move: the next call waits for the same buffer and gets it
    assert pool.acquire(timeout=5) == (first, "a")
    assert pool.stats().waits == 1


class Waits:
    """Work that completes only once a caller waits for it with a timeout (so a pool
    that polled without waiting would never see it done)."""

    def __init__(self, completes: bool = True) -> None:
        self.completes = completes
        self.timeouts: list[float] = []
        self._done = threading.Event()

    def synchronize(self) -> None:
        self._done.wait()

    def query(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float) -> bool:
        self.timeouts.append(timeout)
        if self.completes:
            self._done.set()
        return self._done.wait(min(timeout, 0.01))


def test_acquire_waits_on_work_that_can_be_waited_for() -> None:
    pool = StagingPool(["a"])
    i, _ = pool.acquire()
    work = Waits()
    pool.record(i, work)
    assert pool.acquire(timeout=5) == (0, "a")
    assert work.timeouts and all(0 < t <= 5 for t in work.timeouts)  # waited, within the timeout
    assert pool.stats().waits == 1

    stuck = Waits(completes=False)
    pool.record(0, stuck)
    with pytest.raises(TimeoutError):
        pool.acquire(timeout=0.05)
    assert stuck.timeouts and all(0 < t <= 0.05 for t in stuck.timeouts)
