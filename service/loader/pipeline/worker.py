"""The loader: runs the extents of one load through its stages, on the calling thread.

Stages, in order: the extent planner (:mod:`.extents`) cuts the tensor jobs into reads;
for each extent the branch's handler (:mod:`.branches`) prepares it (a staging buffer,
waited for: the backpressure), reader tasks (:class:`Readers`, up to
``reads_in_flight`` at once) read it into its destination, and, in load order, the
handler hands it on (uploaders per device, :mod:`.upload`; validators,
:mod:`.validation`; hashers, :mod:`.hashing`) and reports its bytes. Every resource a load takes (files, staging
buffers and streams, threads) is owned by one exit stack and released in reverse order:
reads stop before hashing and validations, those before staging buffers are freed.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

from service.loader.devices import Device
from service.loader.pipeline.branches import BRANCHES, CANCELLED, Handler
from service.loader.pipeline.extents import Extent, ExtentLimits, plan_extents
from service.loader.pipeline.hashing import Hashers
from service.loader.pipeline.layout import TensorJob
from service.loader.pipeline.options import LoadOptions
from service.loader.pipeline.sources import SourceFiles
from service.loader.pipeline.stats import StageClock, WorkerStats
from service.loader.pipeline.upload import Uploader
from service.loader.pipeline.validation import Validators
from service.loader.validate import InvalidData

__all__ = ["Readers", "Worker", "WorkerStats", "extent_limits"]

_MIN_STAGING_PAYLOAD = 4096
"""Staging buffers hold at least this many bytes of tensor data (a few blocks of any type)."""


def staging_buffer_nbytes(options: LoadOptions, alignment: int) -> int:
    """Bytes of one staging buffer (before the room kept to align its start)."""
    return max(options.staging_size(alignment), _MIN_STAGING_PAYLOAD + 2 * alignment)


def extent_limits(options: LoadOptions, alignment: int) -> ExtentLimits:
    """The extent sizes of a load whose files need ``alignment`` (the largest)."""
    size = staging_buffer_nbytes(options, alignment)
    return ExtentLimits(
        chunk_nbytes=options.step_nbytes,
        direct_chunk_nbytes=options.direct_chunk_nbytes,
        staging_payload=size - (2 * alignment if alignment > 1 else 0),
    )


class _Done:
    """A read that already ran (one read in flight: no thread)."""

    def result(self) -> None:
        return None


_DONE = _Done()


class Readers:
    """Reader tasks: up to ``n`` reads in flight on their own threads (``n == 1``: each
    read runs on the loader thread), timed as the read stage.

    Args:
        n: reads in flight.
        clock: the read stage's clock.
    """

    def __init__(self, n: int, clock: StageClock) -> None:
        self.n = n
        self.clock = clock
        self._pool = ThreadPoolExecutor(n, thread_name_prefix="hoist-read") if n > 1 else None

    def start(
        self, work: Callable[[Extent, Any], None], extent: Extent, ticket: Any, *, inline: bool = False
    ) -> Future[None] | _Done:
        """Run ``work(extent, ticket)``: now (``inline``, or one read in flight), or on a
        reader thread."""

        if self._pool is None or inline:
            self._timed(work, extent, ticket)
            return _DONE
        return self._pool.submit(self._timed, work, extent, ticket)

    def _timed(self, work: Callable[[Extent, Any], None], extent: Extent, ticket: Any) -> None:
        self.clock.start()
        try:
            work(extent, ticket)
        finally:
            self.clock.stop(extent.nbytes)

    def close(self) -> None:
        """Wait for the reads in flight (they write into the load's buffers) and stop the
        threads. Idempotent."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


class Worker:
    """Runs the jobs of one load on the calling thread.

    Args:
        jobs: the tensor jobs, in load order.
        options: the load's tunables.
        direct: read with ``O_DIRECT`` (direct-io load mode).
        cancel: set to stop at the next chunk.
        report: called with each chunk done, as the bytes of each tensor in it and the
            tensor's index in the plan.
        identities: file index -> the file's identity when its header was parsed; a
            file opened for data must still be that file.

    Attributes:
        stats: what the load did (:class:`WorkerStats`).
        invalid: with check-tensors, tensor name -> the first problem found in it.
        hashes: with hash-tensors, tensor name -> hex xxh3_64 digest of its bytes.
    """

    def __init__(
        self,
        jobs: Sequence[TensorJob],
        options: LoadOptions,
        *,
        direct: bool,
        cancel: threading.Event,
        report: Callable[[list[tuple[int, int]]], None],
        identities: dict[int, tuple[int, int, int, int]] | None = None,
    ) -> None:
        self.jobs = jobs
        self.identities = identities or {}
        self.options = options
        self.direct = direct
        self.cancel = cancel
        self.report = report
        self.stats = WorkerStats(reads_in_flight=options.reads_in_flight)
        self.invalid: dict[str, InvalidData] = {}
        self.files = SourceFiles(direct=direct, identities=self.identities, stats=self.stats)
        self.validators = Validators(
            enabled=options.check_tensors,
            workers=options.validation_workers,
            chunk_nbytes=options.step_nbytes,
            clock=self.stats.clocks["validate"],
        )
        self.hashers = Hashers(
            enabled=options.hash_tensors, chunk_nbytes=options.step_nbytes, clock=self.stats.clocks["hash"]
        )
        self.hashes: dict[str, str] = {}
        self.uploaders: dict[str, Uploader] = {}
        self.handlers: dict[str, Handler] = {}

    # -- what handlers use ------------------------------------------------------------------

    def report_pieces(self, extent: Extent) -> None:
        """Count and report the tensor bytes of ``extent``, one chunk."""
        done = [(piece.hi - piece.lo, piece.job.index) for piece in extent.pieces if piece.hi > piece.lo]
        branches = self.stats.branches
        branches[extent.branch] = branches.get(extent.branch, 0) + sum(n for n, _ in done)
        if done:
            self.report(done)

    def uploader(self, device: Device) -> Uploader:
        """The uploader of ``device``, set up on first use."""
        up = self.uploaders.get(device.name)
        if up is None:
            alignment = max(self.files.alignments().values(), default=1)
            size = staging_buffer_nbytes(self.options, alignment)
            up = Uploader(device, self.options.staging_buffers, size, alignment, self.stats.clocks["upload"])
            self.uploaders[device.name] = up
        return up

    # -- the whole load ---------------------------------------------------------------------

    def run(self) -> None:
        """Perform every job (until cancelled), then wait for queued uploads and
        validations and release streams, staging buffers, threads and files.

        Raises:
            StorageError, OutOfMemoryError, DeviceError: as the jobs meet them.
        """
        ok = False
        with ExitStack() as stack:
            stack.callback(self.files.close)
            stack.callback(self._close_uploaders, lambda: self.cancel.is_set() or not ok)
            stack.callback(lambda: self.validators.close(cancel=self.cancel.is_set() or not ok))
            stack.callback(lambda: self.hashers.close(cancel=self.cancel.is_set() or not ok))
            self.readers = Readers(self.options.reads_in_flight, self.stats.clocks["read"])
            stack.callback(self.readers.close)
            self.handlers = {name: handler(self) for name, handler in BRANCHES.items()}
            self._work()
            ok = True
            self._settle()
        self.invalid = dict(self.validators.invalid)
        self.hashes = dict(self.hashers.digests)

    def _close_uploaders(self, abort: Callable[[], bool]) -> None:
        for name, up in self.uploaders.items():
            self.stats.pools[name] = up.stats()
            up.close(abort=abort())
        self.uploaders.clear()

    def _settle(self) -> None:
        """After the last read: wait for uploads and validations; raise the first error
        among them, or a file that changed while it was read (not when cancelled)."""
        if self.cancel.is_set():
            return
        errors: list[BaseException] = []
        for up in self.uploaders.values():
            try:
                up.drain()
            except BaseException as exc:
                errors.append(exc)
        errors += self.validators.collect()
        errors += self.hashers.collect()
        errors += self.files.changed()
        if errors:
            raise errors[0]

    def _open_files(self) -> None:
        """Open every file that is read (not mapped) now: direct I/O's alignment shapes
        the extents."""
        for job in self.jobs:
            if job.branch in ("read", "staged", "sync", "copy"):
                self.files.open(job)

    def _work(self) -> None:
        self._open_files()
        names: set[str] = set()
        for job in self.jobs:
            if job.name in names:
                self.hashers.skip(job)  # a second copy (a tied output): its bytes are the first's
            names.add(job.name)
        alignments = self.files.alignments()
        # mapped bytes a thread of their own faults in: one extent per run, unless the
        # caller chose the chunk size
        ahead: set[int] = set()
        if self.options.chunk_nbytes is None:
            ahead = {
                j.file_index for j in self.jobs if j.branch == "mapped" and j.mapping and j.mapping.populating_ahead
            }
        limits = extent_limits(self.options, max(alignments.values(), default=1))
        extents = plan_extents(self.jobs, limits, alignments, ahead)
        in_flight: deque[tuple[Extent, Handler, Any, Future[None] | _Done, str | None]] = deque()
        held: dict[str, int] = {}

        def complete_oldest() -> None:
            extent, handler, ticket, read, key = in_flight.popleft()
            if key is not None:
                held[key] -= 1
            read.result()
            handler.complete(extent, ticket)

        for i, extent in enumerate(extents):
            if self.cancel.is_set():
                break
            handler = self.handlers[extent.branch]
            # nothing ahead of an inline extent: prepared, read and completed in place
            now = handler.inline and not in_flight
            key = None
            if not now:
                slots = handler.slots(extent)
                key = slots[0] if slots else None
                while in_flight and (
                    len(in_flight) >= self.readers.n or (slots is not None and held.get(slots[0], 0) >= slots[1])
                ):
                    complete_oldest()
            ticket = handler.prepare(extent)
            if ticket is CANCELLED:
                break
            if now:
                self.readers.start(handler.read, extent, ticket, inline=True)
                handler.complete(extent, ticket)
            else:
                if key is not None:
                    held[key] = held.get(key, 0) + 1
                read = self.readers.start(handler.read, extent, ticket, inline=handler.inline)
                in_flight.append((extent, handler, ticket, read, key))
            if i + 1 < len(extents):
                # hook: the next extent's destination can be readied while this read runs
                self.handlers[extents[i + 1].branch].touch_ahead(extents[i + 1])
            if not now and self.readers.n == 1:
                complete_oldest()
        while in_flight and not self.cancel.is_set():
            complete_oldest()
        in_flight.clear()  # cancelled: the reads still running are waited for on release
