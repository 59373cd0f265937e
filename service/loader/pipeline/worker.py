"""The loader thread: performs every tensor job chunk by chunk, reporting bytes done and
stopping at the next chunk when told to.

Staged uploads go through a :class:`~service.io.staging.StagingPool` per device: each
chunk is read (aligned, for direct I/O) into the next staging buffer, its tensor bytes
are queued for upload on the device's stream and, with check-tensors, for validation on
a worker pool; the buffer is reused only after both are done. Host and mapped tensors
are validated in the same pool once they are in place, while reading goes on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from service.errors import StorageError
from service.io.align import align_down, align_up, aligned_empty
from service.io.direct import DirectFile
from service.io.staging import FutureWaitable, PoolStats, StagingPool
from service.loader.devices import Device, DeviceBuffer, Stream
from service.loader.ggml_types import GGML_TYPES_BY_NAME
from service.loader.pipeline.layout import TensorJob
from service.loader.pipeline.options import LoadOptions
from service.loader.validate import InvalidData, validate_row_data

_MIN_STAGING_PAYLOAD = 4096
"""Staging buffers hold at least this many bytes of tensor data (a few blocks of any type)."""


@dataclass
class WorkerStats:
    """What a load did.

    Attributes:
        branches: bytes per branch (mapped, lazy, copy, read, staged, sync).
        pools: staging pool figures per device.
        direct_io: files read with direct I/O.
        notices: things the user should know (direct I/O fallbacks).
    """

    branches: dict[str, int] = field(default_factory=dict)
    pools: dict[str, PoolStats] = field(default_factory=dict)
    direct_io: list[str] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "bytes_by_branch": dict(self.branches),
            "staging": {name: asdict(s) for name, s in self.pools.items()},
            "direct_io_files": list(self.direct_io),
            "notices": list(self.notices),
        }


class _DevicePool:
    """A device's stream and staging buffers (its host buffer type)."""

    def __init__(self, device: Device, count: int, nbytes: int, alignment: int) -> None:
        assert device.host_buffer_type is not None
        self.device = device
        self.buffers: list[DeviceBuffer] = []
        self.stream: Stream | None = None
        self.shifts: list[int] = []
        try:
            for _ in range(count):
                buf = device.alloc(device.host_buffer_type, nbytes + alignment)
                self.buffers.append(buf)
                addr = int(buf.view(0, 1).ctypes.data)
                self.shifts.append((-addr) % alignment)
            self.stream = device.open_stream()
        except BaseException:
            self.close()
            raise
        if self.stream is None:
            self.close()
            raise RuntimeError(f"{device.name} has no stream for staged uploads")
        self.pool: StagingPool[DeviceBuffer] = StagingPool(self.buffers)

    def close(self) -> None:
        """Close the stream (waiting for its copies) and free the staging buffers."""
        if self.stream is not None:
            self.stream.close()
            self.stream = None
        for buf in self.buffers:
            buf.free()
        self.buffers = []


class Worker:
    """Runs the jobs of one load on the calling thread.

    Args:
        jobs: the tensor jobs, in load order.
        options: the load's tunables.
        direct: read with ``O_DIRECT`` (direct-io load mode).
        cancel: set to stop at the next chunk.
        report: called with the bytes of each chunk done.
    """

    def __init__(
        self,
        jobs: Sequence[TensorJob],
        options: LoadOptions,
        *,
        direct: bool,
        cancel: threading.Event,
        report: Callable[[int], None],
    ) -> None:
        self.jobs = jobs
        self.options = options
        self.direct = direct
        self.cancel = cancel
        self.report = report
        self.files: dict[int, DirectFile] = {}
        self.pools: dict[str, _DevicePool] = {}
        self.validator: ThreadPoolExecutor | None = None
        self.checks: list[tuple[str, Future[InvalidData | None]]] = []
        self.invalid: dict[str, InvalidData] = {}
        self.stats = WorkerStats()
        self._bounce: np.ndarray[Any, np.dtype[np.uint8]] | None = None

    # -- helpers --------------------------------------------------------------------------

    def _file(self, job: TensorJob) -> DirectFile:
        f = self.files.get(job.file_index)
        if f is None:
            f = self.files[job.file_index] = DirectFile(job.path, direct=self.direct)
        return f

    def _alignment(self) -> int:
        return max((f.alignment for f in self.files.values()), default=1)

    def _bounce_buffer(self, alignment: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        size = self.options.staging_size(alignment)
        if self._bounce is None or len(self._bounce) < size:
            self._bounce = aligned_empty(max(size, 2 * alignment + _MIN_STAGING_PAYLOAD), max(alignment, 4096))
        return self._bounce

    def _validate(self, job: TensorJob, data: Any, base: int = 0) -> Future[InvalidData | None] | None:
        """Queue validation of ``data`` (tensor bytes from ``base``); None without checks."""
        if not self.options.check_tensors or not isinstance(data, np.ndarray):
            return None
        if self.validator is None:
            self.validator = ThreadPoolExecutor(self.options.validation_workers, thread_name_prefix="hoist-validate")

        def check() -> InvalidData | None:
            found = validate_row_data(job.ggml_type, data)
            return None if found is None else InvalidData(found.reason, found.offset + base)

        future = self.validator.submit(check)
        self.checks.append((job.name, future))
        return future

    def _done(self, job: TensorJob, n: int) -> None:
        self.stats.branches[job.branch] = self.stats.branches.get(job.branch, 0) + n
        self.report(n)

    def _pool(self, device: Device) -> _DevicePool:
        pool = self.pools.get(device.name)
        if pool is None:
            alignment = self._alignment()
            size = max(self.options.staging_size(alignment), _MIN_STAGING_PAYLOAD + 2 * alignment)
            pool = self.pools[device.name] = _DevicePool(device, self.options.staging_buffers, size, alignment)
        return pool

    # -- branches -------------------------------------------------------------------------

    def _mapped(self, job: TensorJob) -> None:
        assert job.mapping is not None
        chunk = self.options.chunk_nbytes
        for start in range(0, job.nbytes, chunk):
            if self.cancel.is_set():
                return
            n = min(chunk, job.nbytes - start)
            job.mapping.populate(job.offset + start, n)
            if job.branch == "copy":
                assert job.dest is not None
                job.dest.write(job.dest_offset + start, job.mapping.array(job.offset + start, n))
            self._done(job, n)
        if job.lock is not None:
            warning = job.lock.grow_to(job.offset + job.nbytes)
            if warning:
                self.stats.notices.append(warning)
        self._validate(job, job.mapping.array(job.offset, job.nbytes))

    def _read(self, job: TensorJob) -> None:
        assert job.dest is not None
        view = job.dest.view(job.dest_offset, job.nbytes)
        f = self._file(job)
        chunk = self.options.chunk_nbytes
        for start in range(0, job.nbytes, chunk):
            if self.cancel.is_set():
                return
            n = min(chunk, job.nbytes - start)
            self._read_into(f, job, view[start : start + n], job.offset + start)
            self._done(job, n)
        self._validate(job, view)

    def _read_into(self, f: DirectFile, job: TensorJob, dest: np.ndarray[Any, Any], offset: int) -> None:
        try:
            f.read_into(dest.data, offset, self._bounce_buffer(f.alignment))
        except StorageError as exc:
            raise StorageError(exc.message, path=exc.path, offset=exc.offset, tensor=job.name) from exc

    def _sync(self, job: TensorJob) -> None:
        """One temporary buffer the size of the tensor, then one synchronous write."""
        assert job.dest is not None
        temp = aligned_empty(job.nbytes)
        f = self._file(job)
        chunk = self.options.chunk_nbytes
        for start in range(0, job.nbytes, chunk):
            if self.cancel.is_set():
                return
            n = min(chunk, job.nbytes - start)
            self._read_into(f, job, temp[start : start + n], job.offset + start)
            self._done(job, n)
        job.dest.write(job.dest_offset, temp)
        if self.options.check_tensors:
            found = validate_row_data(job.ggml_type, temp)
            if found is not None:
                self.invalid.setdefault(job.name, found)

    def _staged(self, job: TensorJob) -> None:
        """Aligned chunks through the staging buffers, uploaded asynchronously; each chunk
        carries whole blocks so that it can be validated on its own."""
        assert job.dest is not None and job.device is not None
        dev_pool = self._pool(job.device)
        assert dev_pool.stream is not None
        f = self._file(job)
        type_size = GGML_TYPES_BY_NAME[job.ggml_type].type_size
        start = 0
        while start < job.nbytes:
            if self.cancel.is_set():
                return
            a = f.alignment
            payload = max(dev_pool.buffers[0].nbytes - max(dev_pool.shifts) - (2 * a if a > 1 else 0), type_size)
            length = min(max(payload // type_size, 1) * type_size, job.nbytes - start)
            at = job.offset + start
            read_from = align_down(at, a)
            head = at - read_from
            read_len = align_up(head + length, a)
            slot, buf = dev_pool.pool.acquire()
            base = dev_pool.shifts[slot]
            staging = buf.view(base, read_len)
            if a > 1:
                got = f.read_aligned(staging.data, read_from)
                if got < head + length:
                    raise StorageError(
                        f"unexpected end of file in the data of tensor '{job.name}'",
                        path=job.path,
                        offset=read_from + got,
                        tensor=job.name,
                    )
            else:
                self._read_into(f, job, staging[:length], at)
            event = dev_pool.stream.upload(job.dest, job.dest_offset + start, buf, base + head, length)
            future = self._validate(job, staging[head : head + length], start)
            if future is None:
                dev_pool.pool.record(slot, event)
            else:
                dev_pool.pool.record(slot, event, FutureWaitable(future))
            self._done(job, length)
            start += length

    # -- the whole load -------------------------------------------------------------------

    def run(self) -> None:
        """Perform every job (until cancelled), then wait for queued uploads and
        validations and release streams, staging buffers, threads and files.

        Raises:
            StorageError, OutOfMemoryError, DeviceError: as the jobs meet them.
        """
        try:
            self._work()
        except BaseException:
            self._finish(quiet=True)
            raise
        self._finish(quiet=False)

    def _work(self) -> None:
        if self.direct:
            for job in self.jobs:
                if job.branch in ("read", "staged", "sync"):
                    self._file(job)
        for job in self.jobs:
            if self.cancel.is_set():
                break
            if job.branch in ("mapped", "copy"):
                self._mapped(job)
            elif job.branch == "lazy":
                self._validate(job, job.mapping.array(job.offset, job.nbytes) if job.mapping else None)
                self._done(job, job.nbytes)
            elif job.branch == "read":
                self._read(job)
            elif job.branch == "staged":
                self._staged(job)
            else:
                self._sync(job)
        for dev_pool in self.pools.values():
            dev_pool.pool.drain()

    def _finish(self, *, quiet: bool) -> None:
        """Release everything; ``quiet`` drops errors met on the way (another error is
        already on its way out)."""
        errors: list[BaseException] = []
        for name, dev_pool in self.pools.items():
            try:
                dev_pool.pool.drain()
            except BaseException as exc:
                errors.append(exc)
            self.stats.pools[name] = dev_pool.pool.stats()
            dev_pool.close()
        self.pools.clear()
        if self.validator is not None:
            self.validator.shutdown(wait=True, cancel_futures=self.cancel.is_set())
            self.validator = None
        for name, future in self.checks:
            if future.cancelled():
                continue
            try:
                found = future.result()
            except BaseException as exc:
                errors.append(exc)
                continue
            if found is not None and name not in self.invalid:
                self.invalid[name] = found
        for f in self.files.values():
            if self.direct and f.direct:
                self.stats.direct_io.append(f.path)
            elif self.direct and f.fallback:
                self.stats.notices.append(f"direct I/O unavailable for {f.path}: {f.fallback}")
            f.close()
        self.files.clear()
        self._bounce = None
        if errors and not quiet and not self.cancel.is_set():
            raise errors[0]
