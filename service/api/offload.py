"""Blocking request work (header parsing, planning) on a bounded thread pool, with a
bound on the requests that wait for it, a time limit per request, and cancellation when
the client goes away, so that no request blocks the event loop or other requests for
long."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from service.cancel import CancelToken
from service.errors import BusyError

T = TypeVar("T")

Watch = Callable[[], Awaitable[None]]
"""A coroutine function that returns when the work is no longer wanted (the client went
away)."""


class Offloader:
    """Runs blocking request work on ``workers`` threads.

    Args:
        workers: threads (requests whose work runs at once).
        max_waiting: requests that may wait for a thread; beyond, :class:`BusyError`.
        timeout_s: time limit of each request's work, counted from when it starts.
    """

    def __init__(self, workers: int, max_waiting: int, timeout_s: float) -> None:
        self.workers = workers
        self.max_waiting = max_waiting
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="hoist-request")
        self._pending = 0
        self._tokens: set[CancelToken] = set()

    @property
    def pending(self) -> int:
        """Requests whose work runs or waits now."""
        return self._pending

    async def run(self, fn: Callable[[CancelToken], T], *, what: str, watch: Watch | None = None) -> T:
        """``fn(token)`` on a pool thread; the token is cancelled when ``watch`` returns
        or the awaiting task is cancelled, and expires ``timeout_s`` after ``fn`` starts.

        Raises:
            BusyError: ``workers + max_waiting`` requests are pending already.
            RequestAbandonedError, WorkLimitError: from the token, as ``fn`` checks it.
            Whatever ``fn`` raises.
        """
        if self._pending >= self.workers + self.max_waiting:
            raise BusyError(
                f"{self._pending} requests are being worked on or waiting; try again shortly", retry_after=1
            )
        token = CancelToken(None, what)
        loop = asyncio.get_running_loop()

        def body() -> T:
            token.arm(self.timeout_s)
            token.check()
            return fn(token)

        self._pending += 1
        self._tokens.add(token)
        future = loop.run_in_executor(self._pool, body)
        watcher = asyncio.ensure_future(watch()) if watch is not None else None
        try:
            if watcher is not None:
                waiting: set[asyncio.Future[Any]] = {future, watcher}
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if not future.done():
                    token.cancel()
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            token.cancel("the request was cancelled")
            # the thread stops at its next check; wait for it so that it ends before we do
            with contextlib.suppress(BaseException):
                await future
            raise
        finally:
            self._pending -= 1
            self._tokens.discard(token)
            if watcher is not None:
                watcher.cancel()

    def close(self) -> None:
        """Tell the work in progress to stop (at its next check), drop the work still
        queued, and let the threads end."""
        for token in list(self._tokens):
            token.cancel("the service is shutting down")
        self._pool.shutdown(wait=False, cancel_futures=True)
