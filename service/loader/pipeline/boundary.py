"""The one place where the loader thread meets the event loop.

The blocking work of a load (mapping, allocating, locking, then the loader's stages)
runs on one ``hoist-load`` thread; progress crosses to the event loop with
``call_soon_threadsafe``, and cancellation crosses back as a :class:`threading.Event`
the loader checks at every extent.
"""

from __future__ import annotations

import asyncio
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from service.errors import LoadCancelledError
from service.loader.pipeline.layout import Resources
from service.loader.pipeline.options import LoadOptions, Progress, ProgressCallback
from service.loader.pipeline.stats import WorkerStats
from service.loader.pipeline.worker import Worker

T = TypeVar("T")

PROGRESS_POST_SECONDS = 0.01
"""Least time between two hand-overs of progress to the event loop (100 a second)."""


async def run_loader(
    prepare: Callable[[], None],
    identities: dict[int, tuple[int, int, int, int]],
    res: Resources,
    total: int,
    options: LoadOptions,
    direct: bool,
    on_progress: ProgressCallback | None,
    device_of: Sequence[str],
    data_ranges: dict[int, tuple[str, int, int]] | None = None,
    conclude: Callable[[], T] | None = None,
) -> tuple[WorkerStats, dict[str, Any], dict[str, str], T | None]:
    """On a loader thread, ``prepare`` (map, allocate, lock: blocking work that stays off
    the event loop) then run the jobs it put in ``res``, then ``conclude`` (after a load
    that ran to its end); returns the loader's stats, the invalid tensors, the tensor
    hashes (hash-tensors) and what ``conclude`` returned. ``data_ranges`` (file index ->
    path, first byte, end of the data the load brings in) are probed for page-cache
    residency first, before mapping and allocating start any read-ahead.

    Raises:
        LoadCancelledError: the callback asked to stop.
        asyncio.CancelledError: the awaiting task was cancelled; the loader is told to stop
            and awaited first, so nothing is released while it still runs.
    """
    loop = asyncio.get_running_loop()
    cancel = threading.Event()
    done_future: asyncio.Future[None] = loop.create_future()
    state = {"done": 0, "by_callback": False}
    by_device = dict.fromkeys(device_of, 0)

    pending: list[tuple[int, int]] = []
    pending_lock = threading.Lock()
    post = {"scheduled": False, "last": -PROGRESS_POST_SECONDS}

    def deliver() -> None:
        with pending_lock:
            done = pending[:]
            pending.clear()
            post["scheduled"], post["last"] = False, time.monotonic()
        for n, index in done:
            state["done"] += n
            by_device[device_of[index]] += n
            if on_progress is None or cancel.is_set():
                continue
            try:
                stop = on_progress(Progress(state["done"], total, dict(by_device))) is False
            except Exception as exc:
                # one chunk's callback failing must not drop the chunks batched with it:
                # reported as the loop reports a callback that raises, and the load goes on
                loop.call_exception_handler({"message": "exception in a load's progress callback", "exception": exc})
                continue
            if stop:
                state["by_callback"] = True
                cancel.set()

    def report(done: list[tuple[int, int]]) -> None:
        # chunks are handed to the loop in batches, at most one every
        # PROGRESS_POST_SECONDS: each wake-up of the loop takes the interpreter from the
        # loader thread (a callback still runs for every chunk)
        with pending_lock:
            pending.extend(done)
            if post["scheduled"]:
                return
            post["scheduled"] = True
            wait = post["last"] + PROGRESS_POST_SECONDS - time.monotonic()
        if wait <= 0:
            loop.call_soon_threadsafe(deliver)
        else:
            loop.call_soon_threadsafe(loop.call_later, wait, deliver)

    worker = Worker(res.jobs, options, direct=direct, cancel=cancel, report=report, identities=identities)

    def finish(exc: BaseException | None) -> None:
        if done_future.done():
            return
        if exc is None:
            done_future.set_result(None)
        else:
            done_future.set_exception(exc)

    concluded: list[T | None] = [None]

    def body() -> None:
        error: BaseException | None = None
        started = time.perf_counter()
        try:
            for file_index, (path, lo, hi) in (data_ranges or {}).items():
                worker.files.take_residency(file_index, path, lo, hi)
                if worker.files.wholly_resident(file_index):
                    res.resident.add(file_index)
            worker.stats.clocks["touch"].start()
            try:
                prepare()
            finally:
                worker.stats.clocks["touch"].stop(sum(b.nbytes for b in res.buffers))
            worker.jobs = res.jobs
            if not cancel.is_set():
                worker.run()
            if conclude is not None and not cancel.is_set():
                concluded[0] = conclude()
        except BaseException as exc:  # handed to the awaiting task
            # the frames of the traceback hold views of the load's buffers: drop their
            # locals now, so that the buffers go when they are freed, not when a garbage
            # collection happens to break the traceback's reference cycles
            _clear_frames(exc)
            error = exc
        worker.stats.seconds = time.perf_counter() - started
        loop.call_soon_threadsafe(deliver)  # what is still pending, before the result
        loop.call_soon_threadsafe(finish, error)
        error = None

    if on_progress is not None and on_progress(Progress(0, total, dict(by_device))) is False:
        raise LoadCancelledError("the load was cancelled by its progress callback before it started")
    thread = threading.Thread(target=body, name="hoist-load", daemon=True)
    thread.start()
    try:
        await asyncio.shield(done_future)
    except asyncio.CancelledError:
        cancel.set()
        while not done_future.done():
            try:
                await asyncio.shield(done_future)
            except asyncio.CancelledError:
                continue
            except BaseException:
                break
        raise
    finally:
        # the loader has posted its result; it is at most returning now
        thread.join()
    if state["by_callback"]:
        raise LoadCancelledError("the load was cancelled by its progress callback")
    return worker.stats, dict(worker.invalid), dict(worker.hashes), concluded[0]


def _clear_frames(exc: BaseException) -> None:
    """Drop the locals of the finished frames in the tracebacks of ``exc`` and of the
    exceptions it was raised from or during."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        todo += [e.__cause__, e.__context__]
