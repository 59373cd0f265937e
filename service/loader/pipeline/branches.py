"""How each branch brings an extent's bytes in: one handler per branch, chosen from
:data:`BRANCHES`.

A handler works in three steps, so that reads can be in flight while the loader goes on:

- :meth:`Handler.prepare`, on the loader thread, in load order: what the read needs
  (a staging buffer: waiting for it is the backpressure; a temporary buffer);
- :meth:`Handler.read`, on a reader thread: the I/O alone, into the destination;
- :meth:`Handler.complete`, on the loader thread, in load order: hand the bytes on
  (upload, validation, hashing) and report them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from service.errors import StorageError
from service.io.align import PAGE_SIZE, aligned_empty
from service.io.staging import FutureWaitable
from service.io.touch import prefault
from service.loader.devices.base import HostBuffer
from service.loader.pipeline.extents import Extent
from service.loader.pipeline.layout import TensorJob

if TYPE_CHECKING:
    from service.loader.pipeline.worker import Worker

CANCELLED = object()
"""What :meth:`Handler.prepare` returns when the load was cancelled while it waited."""


def _parts(extent: Extent) -> list[tuple[int, int]]:
    """The tensor bytes of ``extent`` (file ranges), without the gaps between tensors."""
    return [(p.lo, p.hi) for p in extent.pieces]


class Handler:
    """A branch's handler (the default steps do nothing).

    Args:
        load: the load it works for (its files, uploaders, validators, stats).
    """

    inline = False
    """Its reads run on the loader thread even with reads in flight: work that costs less
    than handing it to a reader thread and back."""

    def __init__(self, load: Worker) -> None:
        self.load = load

    def slots(self, extent: Extent) -> tuple[str, int] | None:
        """A resource the extent's read holds while in flight, and how many of it there
        are (staging buffers of a device); None when only the reads in flight bound it."""
        return None

    def prepare(self, extent: Extent) -> Any:
        """Set up the extent's read (loader thread); returns what :meth:`read` and
        :meth:`complete` get, or :data:`CANCELLED`."""
        return None

    def touch_ahead(self, extent: Extent) -> None:
        """Prepare the destination of ``extent`` while the read before it is in flight
        (loader thread; nothing by default: buffers are touched when allocated)."""
        return None

    def read(self, extent: Extent, ticket: Any) -> None:
        """Bring the extent's bytes into its destination (reader thread)."""
        return None

    def complete(self, extent: Extent, ticket: Any) -> None:
        """Hand the bytes on and report them (loader thread, in load order)."""
        self.load.report_pieces(extent)


def _check_file(load: Worker, jobs: Iterable[TensorJob]) -> None:
    """Validate and hash ``jobs`` (whole tensors) from their file, where the load does
    (a descriptor is opened only then)."""
    if not (load.validators.enabled or load.hashers.enabled):
        return
    for job in jobs:
        fd = load.files.check_fd(job)
        load.validators.file(job, fd)
        load.hashers.file(job, fd)


class Mapped(Handler):
    """Tensors in a ``CPU_Mapped`` buffer: their pages are faulted in (and locked under
    ``mmap+mlock``); the residency before faulting tells cache from disk.

    Faulting in is one ``madvise`` the kernel carries out (after the read-ahead advice
    over the whole data range at the start), so it runs on the loader thread: on a warm
    2 GiB file, handing each 16 MiB extent to a reader thread and back cost about 50 ms
    per load, more than the faulting itself (about 20 ms)."""

    inline = True

    def read(self, extent: Extent, ticket: Any) -> None:
        job = extent.first
        mapping = job.mapping
        assert mapping is not None
        lo, hi = extent.lo, extent.hi
        if hi <= lo:
            return
        mapping.wait_ahead()
        if self.load.cancel.is_set():
            return  # cancelled while the pages were faulted in ahead: not faulted in here
        self.load.files.count(job.file_index, _parts(extent), buffered=True)
        try:
            mapping.populate(lo, hi - lo)
        except StorageError as exc:
            # named after the first tensor that cannot be faulted in, not the extent's
            # first (a run faulted in ahead is one extent, maybe the whole file)
            for piece in extent.pieces:
                try:
                    mapping.populate(piece.lo, piece.hi - piece.lo, ahead=False)
                except StorageError as found:
                    raise StorageError(
                        found.message, path=found.path, offset=found.offset, tensor=piece.job.name
                    ) from exc
            raise StorageError(exc.message, path=exc.path, offset=exc.offset, tensor=job.name) from exc

    def complete(self, extent: Extent, ticket: Any) -> None:
        if self.load.cancel.is_set():
            return  # its pages may not have been faulted in (see read): nothing to hand on
        _check_file(self.load, (p.job for p in extent.pieces if p.completes))
        self.load.report_pieces(extent)
        lock = extent.first.lock
        if lock is not None:
            # grown tensor by tensor, as llama.cpp's mlock grows after each tensor: with a
            # low RLIMIT_MEMLOCK it locks the whole tensors the limit allows, not up to
            # the extent before it nor into a tensor that an extent cuts
            for piece in extent.pieces:
                if piece.completes and piece.hi > piece.lo:
                    warning = lock.grow_to(piece.hi)
                    if warning:
                        self.load.stats.notices.append(warning)
                        break


class Lazy(Handler):
    """Lazily read tensors: views of the mapping, not read during the load (checked
    with check-tensors)."""

    def complete(self, extent: Extent, ticket: Any) -> None:
        _check_file(self.load, [p.job for p in extent.pieces])
        self.load.report_pieces(extent)


class Read(Handler):
    """Host tensors read straight into their buffer: buffered, or direct reads of the
    aligned superset whose head and tail land in the slack around the run."""

    def touch_ahead(self, extent: Extent) -> None:
        """Tell the destination's touch helper that the reads have reached ``extent``:
        it skips what they write themselves and faults in the pages after it."""
        dest = extent.first.dest
        if isinstance(dest, HostBuffer):
            dest.reads_reached(extent.dest_offset - (extent.lo - extent.read_lo))

    def read(self, extent: Extent, ticket: Any) -> None:
        job = extent.first
        assert job.dest is not None
        lo, hi = extent.lo, extent.hi
        if extent.aligned:
            target = job.dest.view(extent.dest_offset - (lo - extent.read_lo), extent.read_hi - extent.read_lo)
            self.load.files.read(job, target, extent.read_lo, lo, hi, aligned=True, counted=_parts(extent))
        else:
            target = job.dest.view(extent.dest_offset, hi - lo)
            self.load.files.read(job, target, lo, lo, hi, aligned=False, counted=_parts(extent))

    def complete(self, extent: Extent, ticket: Any) -> None:
        for piece in extent.pieces:
            job = piece.job
            assert job.dest is not None
            if self.load.hashers.enabled:
                start = job.dest_offset + (piece.lo - job.offset)
                self.load.hashers.array(job, job.dest.view(start, piece.hi - piece.lo))
            if piece.completes:
                self.load.validators.array(job, job.dest.view(job.dest_offset, job.nbytes))
        self.load.report_pieces(extent)


class Copy(Handler):
    """Under mmap, tensors in an allocated buffer: read with ``pread`` (from the page
    cache the mapping shares), never copied out of the mapping, so that a file that
    shrinks gives an error, not SIGBUS. Device buffers get a synchronous write."""

    def read(self, extent: Extent, ticket: Any) -> None:
        job = extent.first
        assert job.dest is not None
        n = extent.hi - extent.lo
        if job.dest.buffer_type.is_host:
            target = job.dest.view(extent.dest_offset, n)
            if isinstance(target, np.ndarray):
                self.load.files.read(
                    job, target, extent.lo, extent.lo, extent.hi, aligned=False, counted=_parts(extent)
                )
                return
        scratch = self.load.files.bounce(n)[:n]
        self.load.files.read(job, scratch, extent.lo, extent.lo, extent.hi, aligned=False, counted=_parts(extent))
        with self.load.stats.clocks["upload"].busy(n):
            job.dest.write(extent.dest_offset, scratch)

    def complete(self, extent: Extent, ticket: Any) -> None:
        _check_file(self.load, [p.job for p in extent.pieces if p.completes])
        self.load.report_pieces(extent)


class Staged(Handler):
    """Tensors on a device that uploads asynchronously: read into a staging buffer,
    uploaded on the device's stream, validated and hashed there; the buffer is reused
    once all are done.

    Buffered reads run on the loader thread (as llama.cpp's loader reads while the
    stream copies): from the page cache a read into a staging buffer is a memory copy of
    at most a staging buffer's size, which costs less than handing it to a reader thread
    and back, and the loader and the device's stream are then the only two threads at
    work, each about half of it. Direct reads go to the reader threads, several in flight
    (the disk serves them in parallel); meanwhile the loader faults in the destination of
    the next one (:meth:`touch_ahead`)."""

    def __init__(self, load: Worker) -> None:
        super().__init__(load)
        self.inline = not load.direct

    def slots(self, extent: Extent) -> tuple[str, int] | None:
        device = extent.first.device
        assert device is not None
        return device.name, len(self.load.uploader(device).buffers)

    def prepare(self, extent: Extent) -> Any:
        device = extent.first.device
        assert device is not None
        got = self.load.uploader(device).acquire(self.load.cancel.is_set)
        return CANCELLED if got is None else got

    def touch_ahead(self, extent: Extent) -> None:
        """With reads on reader threads, fault in the pages of ``extent``'s destination
        where the device's memory is host memory (an emulated device), on the loader
        thread while the read before it runs: the copy on the device's stream then finds
        them ready instead of zeroing them itself. (With reads on the loader thread the
        stream's copies fault them in: the work stays split in halves.)"""
        dest = extent.first.dest
        if self.inline or dest is None or dest.buffer_type.is_host or extent.hi - extent.lo < PAGE_SIZE:
            return
        view = dest.view(extent.dest_offset, extent.hi - extent.lo)
        if isinstance(view, np.ndarray):
            prefault(view)

    def _staging(self, extent: Extent, ticket: Any) -> tuple[Any, int]:
        """The staging view the extent is read into and the file offset of its start."""
        _, buf, base = ticket
        if extent.aligned:
            return buf.view(base, extent.read_hi - extent.read_lo), extent.read_lo
        return buf.view(base, extent.hi - extent.lo), extent.lo

    def read(self, extent: Extent, ticket: Any) -> None:
        staging, start = self._staging(extent, ticket)
        self.load.files.read(
            extent.first, staging, start, extent.lo, extent.hi, aligned=extent.aligned, counted=_parts(extent)
        )
        if self.inline:
            # on the loader thread, in load order: the upload is queued at once rather
            # than when the read after it is issued, so the stream has one more buffer
            self._hand_on(extent, ticket)

    def complete(self, extent: Extent, ticket: Any) -> None:
        if not self.inline:
            self._hand_on(extent, ticket)
        self.load.report_pieces(extent)

    def _hand_on(self, extent: Extent, ticket: Any) -> None:
        """Queue the extent's validations, hashing and upload from its staging buffer,
        which is reused once they are all done (loader thread, in load order)."""
        slot, _, base = ticket
        job = extent.first
        assert job.dest is not None and job.device is not None
        staging, start = self._staging(extent, ticket)
        checks = []
        for piece in extent.pieces:
            future = self.load.validators.array(
                piece.job, staging[piece.lo - start : piece.hi - start], piece.lo - piece.job.offset
            )
            if future is not None:
                checks.append(FutureWaitable(future))
            hashed = self.load.hashers.array(piece.job, staging[piece.lo - start : piece.hi - start])
            if hashed is not None:
                checks.append(FutureWaitable(hashed))
        n = extent.hi - extent.lo
        if n:
            self.load.uploader(job.device).upload(
                slot, job.dest, extent.dest_offset, base + (extent.lo - start), n, *checks
            )


class Sync(Handler):
    """Tensors on a device without asynchronous copies: read into a temporary buffer the
    size of the tensor, then one synchronous write."""

    def __init__(self, load: Worker) -> None:
        super().__init__(load)
        self.temps: dict[int, np.ndarray[Any, np.dtype[np.uint8]]] = {}

    def prepare(self, extent: Extent) -> Any:
        job = extent.first
        temp = self.temps.get(job.index)
        if temp is None:
            temp = self.temps[job.index] = aligned_empty(job.nbytes)
        return temp

    def read(self, extent: Extent, ticket: Any) -> None:
        job = extent.first
        self.load.files.read(job, ticket, job.offset, extent.lo, extent.hi, aligned=False)

    def complete(self, extent: Extent, ticket: Any) -> None:
        self.load.report_pieces(extent)
        piece = extent.pieces[-1]
        if piece.completes:
            job = piece.job
            assert job.dest is not None
            with self.load.stats.clocks["upload"].busy(job.nbytes):
                job.dest.write(job.dest_offset, ticket)
            self.load.validators.now(job, ticket)
            self.load.hashers.array(job, ticket)
            del self.temps[job.index]


BRANCHES: dict[str, type[Handler]] = {
    "mapped": Mapped,
    "lazy": Lazy,
    "copy": Copy,
    "read": Read,
    "staged": Staged,
    "sync": Sync,
}
"""Branch name -> its handler."""
