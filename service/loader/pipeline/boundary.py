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
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from service.errors import LoadCancelledError
from service.loader.pipeline.layout import Resources
from service.loader.pipeline.options import LoadOptions, Progress, ProgressCallback
from service.loader.pipeline.stats import WorkerStats
from service.loader.pipeline.worker import Worker

T = TypeVar("T")

PROGRESS_POST_SECONDS = 0.01
"""Least time between two hand-overs of progress to the event loop (100 a second)."""


@dataclass(frozen=True)
class LoaderSetup(Generic[T]):
    """What a load does on the loader thread, known once it is planned.

    Attributes:
        total: tensor bytes the load brings in.
        device_of: plan index -> the device name a tensor's bytes count for.
        identities: file index -> the file's identity when its header was parsed.
        direct: read with ``O_DIRECT`` (direct-io load mode).
        data_ranges: file index -> (path, first byte, end) of the data the load brings
            in, probed for page-cache residency before mapping and allocating start any
            read-ahead.
        prepare: map, allocate and lock, and put the jobs in the resources.
        conclude: after a load that ran to its end, what the load returns.
    """

    total: int
    device_of: Sequence[str]
    identities: dict[int, tuple[int, int, int, int]]
    direct: bool
    data_ranges: dict[int, tuple[str, int, int]]
    prepare: Callable[[], None]
    conclude: Callable[[], T]


async def run_loader(
    setup: Callable[[], LoaderSetup[T]],
    res: Resources,
    options: LoadOptions,
    on_progress: ProgressCallback | None,
) -> tuple[WorkerStats, dict[str, Any], dict[str, str], T]:
    """On one loader thread: ``setup`` (the plan, and the checks made before anything is
    taken), the page-cache probe of its data ranges, its ``prepare`` (blocking work that
    stays off the event loop), the jobs that put in ``res``, then its ``conclude``.
    Returns the loader's stats, the invalid tensors, the tensor hashes (hash-tensors)
    and what ``conclude`` returned. A load that fails or stops before its ``conclude``
    releases ``res`` on the loader thread before this returns.

    ``on_progress`` is called on the event loop: first with nothing done (once the
    total is known), then after each chunk.

    Raises:
        LoadCancelledError: the callback asked to stop.
        asyncio.CancelledError: the awaiting task was cancelled; the loader is told to stop
            and awaited first, so nothing is released while it still runs.
        What ``setup``, ``prepare`` and the jobs raise.
    """
    loop = asyncio.get_running_loop()
    cancel = res.cancel
    done_future: asyncio.Future[None] = loop.create_future()
    state = {"done": 0, "total": 0, "by_callback": False}
    by_device: dict[str, int] = {}
    device_of: Sequence[str] = ()

    pending: list[list[tuple[int, int]]] = []
    pending_lock = threading.Lock()
    post = {"scheduled": False, "last": -PROGRESS_POST_SECONDS}

    def call(progress: Progress) -> None:
        if on_progress is None or cancel.is_set():
            return
        try:
            stop = on_progress(progress) is False
        except Exception as exc:
            # one chunk's callback failing must not drop the chunks batched with it:
            # reported as the loop reports a callback that raises, and the load goes on
            loop.call_exception_handler({"message": "exception in a load's progress callback", "exception": exc})
            return
        if stop:
            state["by_callback"] = True
            cancel.set()

    def deliver() -> None:
        with pending_lock:
            done = pending[:]
            pending.clear()
            post["scheduled"], post["last"] = False, time.monotonic()
        for chunk in done:
            for n, index in chunk:
                state["done"] += n
                by_device[device_of[index]] += n
            call(Progress(state["done"], state["total"], dict(by_device)))

    def report(chunk: list[tuple[int, int]]) -> None:
        # chunks are handed to the loop in batches, at most one every
        # PROGRESS_POST_SECONDS: each wake-up of the loop takes the interpreter from the
        # loader thread (a callback still runs for every chunk)
        with pending_lock:
            pending.append(chunk)
            if post["scheduled"]:
                return
            post["scheduled"] = True
            wait = post["last"] + PROGRESS_POST_SECONDS - time.monotonic()
        if wait <= 0:
            loop.call_soon_threadsafe(deliver)
        else:
            loop.call_soon_threadsafe(loop.call_later, wait, deliver)

    worker: list[Worker] = []
    concluded: list[T] = []

    def finish(exc: BaseException | None) -> None:
        if done_future.done():
            return
        if exc is None:
            done_future.set_result(None)
        else:
            done_future.set_exception(exc)

    def body() -> None:
        nonlocal device_of
        error: BaseException | None = None
        started = time.perf_counter()
        try:
            how = setup()
            # set before the first chunk is posted: the loop reads them in deliver
            device_of, state["total"] = how.device_of, how.total
            by_device.update(dict.fromkeys(how.device_of, 0))
            loop.call_soon_threadsafe(call, Progress(0, how.total, dict(by_device)))
            w = Worker(res.jobs, options, direct=how.direct, cancel=cancel, report=report, identities=how.identities)
            worker.append(w)
            for file_index, (path, lo, hi) in how.data_ranges.items():
                if file_index in res.resident:  # probed whole before the plan
                    w.files.note_resident(file_index, lo, hi)
                    continue
                w.files.take_residency(file_index, path, lo, hi)
                if w.files.wholly_resident(file_index):
                    res.resident.add(file_index)
            w.stats.clocks["touch"].start()
            try:
                if not cancel.is_set():
                    how.prepare()
            finally:
                w.stats.clocks["touch"].stop(sum(b.nbytes for b in res.buffers))
            w.jobs = res.jobs
            if not cancel.is_set():
                w.run()
            if not cancel.is_set():
                concluded.append(how.conclude())
        except BaseException as exc:  # handed to the awaiting task
            # the frames of the traceback hold views of the load's buffers: drop their
            # locals now, so that the buffers go when they are freed, not when a garbage
            # collection happens to break the traceback's reference cycles
            _clear_frames(exc)
            error = exc
        if error is not None or not concluded:
            # a load that ends here lets go of what it took on this thread, not on the
            # event loop: stopping a populate-ahead thread waits for the step it is in
            try:
                res.release()
            except BaseException as exc:
                _clear_frames(exc)
                error = error or exc
        if worker:
            worker[0].stats.seconds = time.perf_counter() - started
        loop.call_soon_threadsafe(deliver)  # what is still pending, before the result
        loop.call_soon_threadsafe(finish, error)
        error = None

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
        concluded.clear()  # the caller releases what it holds views of
        raise
    finally:
        # the loader has posted its result; it is at most returning now
        thread.join()
    if state["by_callback"] or not concluded:
        concluded.clear()
        raise LoadCancelledError("the load was cancelled by its progress callback")
    w = worker[0]
    return w.stats, dict(w.invalid), dict(w.hashes), concluded[0]


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
