"""The loader thread: performs every tensor job chunk by chunk, reporting bytes done and
stopping at the next chunk when told to.

Staged uploads go through a :class:`~service.io.staging.StagingPool` per device: each
chunk is read (aligned, for direct I/O) into the next staging buffer, its tensor bytes
are queued for upload on the device's stream and, with check-tensors, for validation on
a worker pool; the buffer is reused only after both are done. Host and mapped tensors
are validated in the same pool once they are in place, while reading goes on.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from service.errors import StorageError
from service.io.align import align_down, align_up, aligned_empty
from service.io.direct import DirectFile
from service.io.file import open_readonly
from service.io.staging import FutureWaitable, PoolStats, StagingPool
from service.loader.devices import Device, DeviceBuffer, Stream
from service.loader.ggml_types import GGML_TYPES_BY_NAME
from service.loader.pipeline.layout import TensorJob, check_identity
from service.loader.pipeline.options import LoadOptions
from service.loader.placement.buffers import RUN_ALIGNMENT
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


def runs(jobs: Sequence[TensorJob]) -> list[list[TensorJob]]:
    """Group consecutive jobs that one call can serve: mapped tensors contiguous in a
    file (a gap below 4096 bytes is padding), and host reads contiguous in the file as in
    their buffer. Every other job is a run of its own."""
    out: list[list[TensorJob]] = []
    for job in jobs:
        if out:
            prev = out[-1][-1]
            same = prev.branch == job.branch and prev.file_index == job.file_index
            if same and job.branch == "mapped" and prev.lock is job.lock:
                if 0 <= job.offset - (prev.offset + prev.nbytes) < RUN_ALIGNMENT:
                    out[-1].append(job)
                    continue
            if same and job.branch == "read" and prev.dest is job.dest and prev.in_place == job.in_place:
                if job.offset - prev.offset == job.dest_offset - prev.dest_offset > 0:
                    out[-1].append(job)
                    continue
        out.append([job])
    return out


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
        report: called with the bytes of each chunk done and the index (in the plan) of
            the tensor they belong to.
        identities: file index -> the file's identity when its header was parsed; a
            file opened for data must still be that file.
    """

    def __init__(
        self,
        jobs: Sequence[TensorJob],
        options: LoadOptions,
        *,
        direct: bool,
        cancel: threading.Event,
        report: Callable[[int, int], None],
        identities: dict[int, tuple[int, int, int, int]] | None = None,
    ) -> None:
        self.jobs = jobs
        self.identities = identities or {}
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
        self._copy_bounce: np.ndarray[Any, np.dtype[np.uint8]] | None = None
        self._check_fds: dict[int, int] = {}

    # -- helpers --------------------------------------------------------------------------

    def _file(self, job: TensorJob) -> DirectFile:
        f = self.files.get(job.file_index)
        if f is None:
            f = self.files[job.file_index] = DirectFile(job.path, direct=self.direct)
            check_identity(job.path, self.identities.get(job.file_index, (0, 0, 0, 0)), f.identity)
        return f

    def _alignment(self) -> int:
        return max((f.alignment for f in self.files.values()), default=1)

    def _bounce_buffer(self, alignment: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        size = self.options.staging_size(alignment)
        if self._bounce is None or len(self._bounce) < size:
            self._bounce = aligned_empty(max(size, 2 * alignment + _MIN_STAGING_PAYLOAD), max(alignment, 4096))
        return self._bounce

    def _validation_pool(self) -> ThreadPoolExecutor:
        if self.validator is None:
            self.validator = ThreadPoolExecutor(self.options.validation_workers, thread_name_prefix="hoist-validate")
        return self.validator

    def _validate(self, job: TensorJob, data: Any, base: int = 0) -> Future[InvalidData | None] | None:
        """Queue validation of ``data`` (tensor bytes from ``base``); None without checks."""
        if not self.options.check_tensors or not isinstance(data, np.ndarray):
            return None

        def check() -> InvalidData | None:
            found = validate_row_data(job.ggml_type, data)
            return None if found is None else InvalidData(found.reason, found.offset + base)

        future = self._validation_pool().submit(check)
        self.checks.append((job.name, future))
        return future

    def _validate_file(self, job: TensorJob) -> None:
        """Queue validation of a tensor that lies in a mapping, reading its bytes with
        ``pread`` rather than through the mapping: a file that shrinks meanwhile then
        gives an error, never SIGBUS."""
        if not self.options.check_tensors:
            return
        fd = self._validation_fd(job)
        type_size = GGML_TYPES_BY_NAME[job.ggml_type].type_size
        step = max(1, self.options.chunk_nbytes // type_size) * type_size

        def check() -> InvalidData | None:
            for start in range(0, job.nbytes, step):
                n = min(step, job.nbytes - start)
                data = os.pread(fd, n, job.offset + start)
                if len(data) < n:
                    raise StorageError(
                        f"unexpected end of file in the data of tensor '{job.name}' (did the file shrink?)",
                        path=job.path,
                        offset=job.offset + start + len(data),
                        tensor=job.name,
                    )
                found = validate_row_data(job.ggml_type, data)
                if found is not None:
                    return InvalidData(found.reason, found.offset + start)
            return None

        self.checks.append((job.name, self._validation_pool().submit(check)))

    def _validation_fd(self, job: TensorJob) -> int:
        fd = self._check_fds.get(job.file_index)
        if fd is None:
            fd = self._check_fds[job.file_index] = open_readonly(job.path)
            st = os.fstat(fd)
            opened = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            check_identity(job.path, self.identities.get(job.file_index, (0, 0, 0, 0)), opened)
        return fd

    def _changed_files(self) -> list[StorageError]:
        """A file read from that changed (size or modification time) since it was opened:
        bytes read before and after the change may not belong together."""
        out = []
        for f in self.files.values():
            try:
                st = os.fstat(f.fd)
            except OSError as exc:
                out.append(StorageError(f"cannot check the file after reading it: {exc.strerror}", path=f.path))
                continue
            if (st.st_size, st.st_mtime_ns) != (f.identity[2], f.identity[3]):
                out.append(
                    StorageError(
                        f"the file changed while it was read ({f.identity[2]} bytes then, {st.st_size} now)",
                        path=f.path,
                    )
                )
        return out

    def _done(self, job: TensorJob, n: int) -> None:
        self.stats.branches[job.branch] = self.stats.branches.get(job.branch, 0) + n
        self.report(n, job.index)

    def _pool(self, device: Device) -> _DevicePool:
        pool = self.pools.get(device.name)
        if pool is None:
            alignment = self._alignment()
            size = max(self.options.staging_size(alignment), _MIN_STAGING_PAYLOAD + 2 * alignment)
            pool = self.pools[device.name] = _DevicePool(device, self.options.staging_buffers, size, alignment)
        return pool

    # -- branches -------------------------------------------------------------------------

    def _report_run(
        self,
        run: Sequence[TensorJob],
        covered: tuple[int, int],
        state: list[int],
        complete: Callable[[TensorJob], object],
    ) -> None:
        """Report the tensor bytes of ``run`` inside the file range ``covered`` (``state``
        is [next job, bytes of it already reported]) and call ``complete`` on each job
        whose bytes are all in place."""
        lo, hi = covered
        while state[0] < len(run):
            job = run[state[0]]
            end = job.offset + job.nbytes
            upto = min(hi, end) - max(lo, job.offset + state[1])
            if upto > 0:
                state[1] += upto
                self._done(job, upto)
            if state[1] < job.nbytes or hi < end:
                break
            complete(job)
            state[0] += 1
            state[1] = 0

    def _mapped(self, run: Sequence[TensorJob]) -> None:
        """Fault in a run of mapped tensors (contiguous in the file) chunk by chunk."""
        first, last = run[0], run[-1]
        mapping = first.mapping
        assert mapping is not None
        begin, end = first.offset, last.offset + last.nbytes
        chunk = self.options.chunk_nbytes
        state = [0, 0]

        def complete(job: TensorJob) -> None:
            self._validate_file(job)

        for lo in range(begin, max(end, begin + 1), chunk):
            if self.cancel.is_set():
                return
            hi = min(lo + chunk, end)
            try:
                mapping.populate(lo, hi - lo)
            except StorageError as exc:
                name = run[min(state[0], len(run) - 1)].name
                raise StorageError(exc.message, path=exc.path, offset=exc.offset, tensor=name) from exc
            self._report_run(run, (lo, hi), state, complete)
        if first.lock is not None:
            warning = first.lock.grow_to(end)
            if warning:
                self.stats.notices.append(warning)

    def _copy(self, job: TensorJob) -> None:
        """Under mmap, bring a tensor that lies in an allocated buffer (a device's, or a
        host buffer that does not wrap the mapping) into it.

        The bytes are read through the file (``pread``, from the page cache the mapping
        shares), never through the mapping: a file that shrinks meanwhile then gives a
        short read and a :class:`StorageError`, where touching the mapped pages past
        its new end would raise SIGBUS and kill the process."""
        assert job.dest is not None
        f = self._file(job)
        chunk = self.options.chunk_nbytes
        host = job.dest.buffer_type.is_host
        for start in range(0, job.nbytes, chunk):
            if self.cancel.is_set():
                return
            n = min(chunk, job.nbytes - start)
            target = job.dest.view(job.dest_offset + start, n) if host else None
            if isinstance(target, np.ndarray):
                self._read_into(f, job, target, job.offset + start)
            else:
                bounce = self._copy_buffer(n)
                self._read_into(f, job, bounce, job.offset + start)
                job.dest.write(job.dest_offset + start, bounce)
            self._done(job, n)
        self._validate_file(job)

    def _copy_buffer(self, n: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """``n`` bytes of a host buffer reused by the copies of the mmap branch."""
        if self._copy_bounce is None or len(self._copy_bounce) < n:
            self._copy_bounce = aligned_empty(max(n, self.options.chunk_nbytes))
        return self._copy_bounce[:n]

    def _read(self, run: Sequence[TensorJob]) -> None:
        """Read a run of host tensors (contiguous in the file as in their buffer) straight
        into the buffer: buffered, or direct reads of the aligned superset, whose head and
        tail land in the slack the host layout leaves around runs."""
        first, last = run[0], run[-1]
        assert first.dest is not None
        f = self._file(first)
        begin, end = first.offset, last.offset + last.nbytes
        state = [0, 0]

        def complete(job: TensorJob) -> None:
            assert job.dest is not None
            self._validate(job, job.dest.view(job.dest_offset, job.nbytes))

        pos = begin
        if pos == end:
            self._report_run(run, (pos, end), state, complete)
        while pos < end:
            if self.cancel.is_set():
                return
            a = f.alignment
            if first.in_place and 1 < a <= RUN_ALIGNMENT:
                read_from = align_down(pos, a)
                n = min(align_up(self.options.direct_chunk_nbytes, a), align_up(end, a) - read_from)
                dest = first.dest.view(first.dest_offset + (read_from - begin), n)
                got = f.read_aligned(dest.data, read_from)
                hi = min(read_from + got, end)
                if hi <= pos:
                    raise StorageError(
                        f"unexpected end of file in the data of tensor '{run[state[0]].name}'",
                        path=first.path,
                        offset=pos,
                        tensor=run[state[0]].name,
                    )
            else:
                hi = min(pos + self.options.chunk_nbytes, end)
                dest = first.dest.view(first.dest_offset + (pos - begin), hi - pos)
                self._read_into(f, run[state[0]], dest, pos)
            self._report_run(run, (pos, hi), state, complete)
            pos = hi

    def _read_into(self, f: DirectFile, job: TensorJob, dest: np.ndarray[Any, Any], offset: int) -> None:
        bounce = self._bounce_buffer(f.alignment) if f.direct else np.empty(0, dtype=np.uint8)
        try:
            f.read_into(dest.data, offset, bounce)
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
        for run in runs(self.jobs):
            if self.cancel.is_set():
                break
            job = run[0]
            if job.branch == "mapped":
                self._mapped(run)
            elif job.branch == "read":
                self._read(run)
            elif job.branch == "copy":
                self._copy(job)
            elif job.branch == "lazy":
                self._validate_file(job)
                self._done(job, job.nbytes)
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
            if self.cancel.is_set() and dev_pool.stream is not None:
                dev_pool.stream.abort()  # copies still queued are not wanted any more
            try:
                dev_pool.pool.drain()
            except BaseException as exc:
                if not self.cancel.is_set():
                    errors.append(exc)
            self.stats.pools[name] = dev_pool.pool.stats()
            dev_pool.close()
        self.pools.clear()
        if self.validator is not None:
            self.validator.shutdown(wait=True, cancel_futures=self.cancel.is_set())
            self.validator = None
        for fd in self._check_fds.values():
            os.close(fd)
        self._check_fds.clear()
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
        if not quiet and not self.cancel.is_set():
            errors.extend(self._changed_files())
        for f in self.files.values():
            if self.direct and f.direct:
                self.stats.direct_io.append(f.path)
            elif self.direct and f.fallback:
                self.stats.notices.append(f"direct I/O unavailable for {f.path}: {f.fallback}")
            f.close()
        self.files.clear()
        self._bounce = None
        self._copy_bounce = None
        if errors and not quiet and not self.cancel.is_set():
            raise errors[0]
