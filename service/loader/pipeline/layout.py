"""From a plan to memory and work: map the files, allocate and lock the buffers, and
list one job per tensor with the branch that brings its bytes in.

Branches (llama.cpp ``load_all_data``):

- ``mapped``: the tensor lies in a ``CPU_Mapped`` buffer: it is a view of the mapping;
  its pages are faulted in (and locked under ``mmap+mlock``).
- ``lazy``: a lazily read tensor: a view of the mapping, read on demand, not loaded.
- ``copy``: under mmap, a tensor in an allocated buffer is copied from the mapping.
- ``read``: without mmap, a tensor in a host buffer is read straight into it.
- ``staged``: without mmap, a tensor on a device that can upload asynchronously goes
  through the staging buffers.
- ``sync``: without mmap, a tensor on a device that cannot (no async copies, events or
  host buffer type) is read into a temporary buffer the size of the tensor and written.

Without mmap, device contexts are loaded before host ones, and within a context the
device tensors come first: staged ones in buffer (file) order, synchronous ones biggest
first.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from service.errors import StorageError
from service.io import residency
from service.io.align import align_up
from service.io.file import open_readonly
from service.io.mapping import Mapping
from service.io.meter import HOST_MEMORY
from service.io.mlock import MemoryLock
from service.io.readahead import advise_mapping, merge_ranges, will_read
from service.loader.devices import Device, DeviceBuffer
from service.loader.devices.cpu import host_memory
from service.loader.placement import LoadMode, Plan, TensorPlacement
from service.loader.placement.buffers import host_layout
from service.loader.weights import WeightIndex

Branch = Literal["mapped", "lazy", "copy", "read", "staged", "sync"]


@dataclass(slots=True)
class TensorJob:
    """Bring one placed tensor's bytes to its place (not changed once built; a plain
    dataclass, as a frozen one costs several times more to build, hundreds per load).

    Attributes:
        index: the tensor's index in the plan.
        name: the tensor name.
        ggml_type: its ggml type name.
        file_index: the file holding its data.
        path: that file.
        offset: absolute byte offset of its data in the file.
        nbytes: its size in bytes.
        branch: how its bytes come in.
        mapping: the file's mapping (mapped, lazy and copy branches).
        dest: its buffer (copy, read, staged and sync branches).
        dest_offset: its offset in ``dest``.
        device: the device uploading it (staged branch).
        lock: the mapping's lock that grows over it (``mmap+mlock``, mapped branch).
        in_place: its run has the slack around it that direct reads of the run's aligned
            superset need to land in place (read branch, direct I/O).
    """

    index: int
    name: str
    ggml_type: str
    file_index: int
    path: str
    offset: int
    nbytes: int
    branch: Branch
    mapping: Mapping | None = None
    dest: DeviceBuffer | None = None
    dest_offset: int = 0
    device: Device | None = None
    lock: MemoryLock | None = None
    in_place: bool = False


def pread_tensor(job: TensorJob, fd: int, start: int, n: int) -> bytes:
    """``n`` bytes of ``job``'s data from its byte ``start``, read from ``fd`` (its file)
    with ``pread``, never through a mapping: a file that shrank gives an error, not
    SIGBUS.

    Raises:
        StorageError: the file ends before those bytes (naming the tensor and offset).
    """
    data = os.pread(fd, n, job.offset + start)
    if len(data) < n:
        raise StorageError(
            f"unexpected end of file in the data of tensor '{job.name}' (did the file shrink?)",
            path=job.path,
            offset=job.offset + start + len(data),
            tensor=job.name,
        )
    return data


class Resources:
    """What a load holds; released together on failure, cancellation or close.

    The tensor views and jobs live here too, so that releasing drops every reference to
    the buffers even while a traceback still holds the load's frames.
    """

    def __init__(self) -> None:
        self.mappings: dict[int, Mapping] = {}
        self.buffers: list[DeviceBuffer] = []
        self.locks: list[MemoryLock] = []
        self.views: dict[int, Any] = {}
        self.jobs: list[TensorJob] = []
        self.warnings: list[str] = []
        self.loaded: Any = None
        """What the load gives back (its tensors with their typed views), made before the
        bytes come in."""
        self.resident: set[int] = set()
        """Files whose tensor data was wholly in the page cache when the load began (known
        before the plan for the files :func:`map_ahead` maps)."""
        self.early_locks: dict[int, MemoryLock] = {}
        """File index -> the lock on fault :func:`map_ahead` took over the file before
        faulting it in (``mmap+mlock``); :func:`build` keeps it or drops it."""
        self.cancel = threading.Event()
        """Set when the load is to stop: the threads faulting its files in ahead end after
        their step in progress."""

    def release(self) -> None:
        """Unlock, free and unmap everything. Idempotent."""
        self.views.clear()
        self.loaded = None
        self.jobs.clear()
        for lock in self.locks:
            lock.release()
        self.locks.clear()
        self.early_locks.clear()
        for buf in self.buffers:
            buf.free()
        self.buffers.clear()
        for mapping in self.mappings.values():
            mapping.close()
        self.mappings.clear()


def check_identity(path: str, parsed: tuple[int, int, int, int], opened: tuple[int, int, int, int]) -> None:
    """Raise StorageError when the file opened for data is not the one whose header was
    parsed (replaced, rewritten or resized since)."""
    if parsed != (0, 0, 0, 0) and parsed != opened:
        what = f"{parsed[2]} bytes then, {opened[2]} now" if parsed[2] != opened[2] else "it was replaced or rewritten"
        raise StorageError(f"the file changed since its header was read ({what})", path=path)


def _host_address(buf: DeviceBuffer) -> int | None:
    view = buf.view(0, buf.nbytes)
    return int(view.ctypes.data) if isinstance(view, np.ndarray) and buf.nbytes else None


def _read_ahead(index: WeightIndex, p: Plan) -> None:
    """Start the kernel reading each file's tensor data (buffered loads), before the
    buffers are allocated and while they are being filled."""
    available = host_memory().free
    by_file: dict[int, list[tuple[int, int]]] = {}
    for t in p.tensors:
        if not t.lazy:
            by_file.setdefault(t.file_index, []).append((t.offset, t.nbytes))
    for file_index, ranges in by_file.items():
        available -= will_read(index.files[file_index].path, ranges, available)


def map_ahead(index: WeightIndex, res: Resources, *, lock: bool = False) -> None:
    """Before planning a load that maps its files and reads none of them lazily: map
    each file whose data section is wholly in the page cache and start faulting it in,
    so that the faulting overlaps the planning (llama.cpp maps with ``MAP_POPULATE``
    before it creates the tensors). :func:`build` uses these mappings. A file that
    cannot be probed, opened or mapped, or that changed since it was parsed, is left
    to :func:`build`, which reports it.

    ``lock`` (``mmap+mlock``): each such file is first locked on fault to its end, where
    the lock limit allows, so that its pages are locked as they are faulted in. Locking
    pages already faulted in would walk them all (about 1.7 ms for 2 GiB) and wait for
    a populate in progress, which holds the address space's lock.
    """
    for file_index, gguf_file in enumerate(index.files):
        lo, hi = gguf_file.data_offset, gguf_file.file_size
        if hi <= lo or file_index in res.mappings:
            continue
        try:
            fd = open_readonly(gguf_file.path)
        except StorageError:
            continue
        try:
            _, npages, cached = residency.cached_span(fd, lo, hi)
            if cached != npages or not residency.trusted(fd):
                continue
            mapping = Mapping(gguf_file.path, fd=fd)  # the file probed, not opened again
        except StorageError:
            continue
        finally:
            os.close(fd)
        res.mappings[file_index] = mapping
        if gguf_file.identity not in ((0, 0, 0, 0), mapping.identity):
            continue  # build meets the change and reports it
        res.resident.add(file_index)
        if lock:
            early = MemoryLock(mapping.addr, gguf_file.path, HOST_MEMORY)
            if early.prelock(hi):
                res.locks.append(early)
                res.early_locks[file_index] = early
        mapping.populate_ahead([(lo, hi - lo)], res.cancel)


def build(index: WeightIndex, p: Plan, devices: Sequence[Device], res: Resources) -> None:
    """Map, allocate and lock what ``p`` needs, and fill ``res.views`` (plan index ->
    raw view of the tensor's bytes) and ``res.jobs`` in load order.

    Raises:
        OutOfMemoryError: an allocation failed.
        StorageError: a file cannot be mapped, or changed since it was parsed.
    """
    by_name = {d.name: d for d in devices}
    direct = p.load_mode is LoadMode.DIRECT_IO
    if not p.use_mmap and not direct:
        _read_ahead(index, p)
    in_place: set[int] = set()
    lock_host = p.load_mode is LoadMode.MLOCK
    lock_mapped = p.load_mode is LoadMode.MMAP_MLOCK
    dest_of: dict[int, tuple[DeviceBuffer, int, Device]] = {}
    for b in p.buffers:
        if b.mapped:
            continue
        dev = by_name[b.device]
        buft = next(bt for bt in dev.buffer_types() if bt.name == b.buffer_type)
        if buft.is_host and len(b.chunks) == 1:
            layout = host_layout([p.tensors[i] for i in b.tensors], buft.alignment, direct=direct)
            buf = dev.alloc(buft, layout.nbytes)
            res.buffers.append(buf)
            for i, off, slack in zip(b.tensors, layout.offsets, layout.slack, strict=True):
                dest_of[i] = (buf, off, dev)
                if slack:
                    in_place.add(i)
            continue
        chunks = iter(b.chunks)
        buf = dev.alloc(buft, next(chunks))
        res.buffers.append(buf)
        pos = 0
        for i in b.tensors:
            size = align_up(p.tensors[i].nbytes, buft.alignment)
            if pos and pos + size > buf.nbytes:
                buf = dev.alloc(buft, next(chunks))
                res.buffers.append(buf)
                pos = 0
            dest_of[i] = (buf, pos, dev)
            pos += size
    if lock_host:
        for buf in res.buffers:
            addr = _host_address(buf) if buf.buffer_type.is_host else None
            if addr is not None:
                lock = MemoryLock(addr, f"a {buf.buffer_type.name} buffer", on_fault=True)
                res.locks.append(lock)
                warning = lock.grow_to(buf.nbytes)
                if warning:
                    res.warnings.append(warning)
                    break

    by_file: dict[int, list[tuple[int, TensorPlacement]]] = {}
    for i, t in enumerate(p.tensors):
        if p.use_mmap or t.lazy:
            by_file.setdefault(t.file_index, []).append((i, t))
    file_locks: dict[int, MemoryLock] = {}
    for file_index in [i for i in res.early_locks if i not in by_file]:
        # no tensor of the plan lies in the file: it is unmapped when the load ends, and
        # its lock is let go now, while the range is certainly still this mapping's
        res.early_locks.pop(file_index).drop_prelock()
    for file_index in sorted(by_file):
        gguf_file = index.files[file_index]
        mapping = res.mappings.get(file_index) or Mapping(gguf_file.path)
        res.mappings[file_index] = mapping
        check_identity(gguf_file.path, gguf_file.identity, mapping.identity)
        resident = file_index in res.resident
        # lazy ranges are read at random, on demand; the rest is needed now (read-ahead
        # only where it is not all in the page cache already)
        advise_mapping(
            mapping,
            () if resident else ((t.offset, t.nbytes) for _, t in by_file[file_index] if not t.lazy),
            ((t.offset, t.nbytes) for _, t in by_file[file_index] if t.lazy),
        )
        if lock_mapped:
            early = res.early_locks.pop(file_index, None)
            lock = file_locks[file_index] = early or MemoryLock(mapping.addr, gguf_file.path, HOST_MEMORY)
            if early is None:
                res.locks.append(lock)
            tensors = [t for _, t in by_file[file_index]]
            target = max(t.offset + t.nbytes for t in tensors)
            whole = not any(t.lazy or i in dest_of for i, t in by_file[file_index])
            if lock.covers(target) or (whole and lock.prelock(target)):
                # the load faults in every page of its tensors (and the padding between
                # them); with the header's pages faulted in too, locking pages as they
                # fault in locks what llama.cpp's lock, grown from the file's start, does
                # (the header is in no range faulted in ahead: no wait for that thread).
                # A lock map_ahead took to the file's end also holds the pages of tensors
                # copied elsewhere that lie past the last mapped one, until the load
                # unmaps them as unused.
                mapping.populate(0, min(t.offset for t in tensors), ahead=False)
        if resident and not mapping.populating_ahead:
            # nothing to read from disk: the mapped tensors' pages are faulted in on a
            # thread of their own while the jobs are built and planned
            mapping.populate_ahead(
                merge_ranges((t.offset, t.nbytes) for i, t in by_file[file_index] if not t.lazy and i not in dest_of),
                res.cancel,
            )

    for i, t in enumerate(p.tensors):
        file_mapping = res.mappings.get(t.file_index)
        path = index.files[t.file_index].path
        if i not in dest_of:
            # in a context that wraps the mapping (zero-byte tensors fall in no range)
            assert file_mapping is not None
            res.views[i] = file_mapping.array(t.offset, t.nbytes)
            job = TensorJob(
                i, t.name, t.ggml_type, t.file_index, path, t.offset, t.nbytes, "lazy" if t.lazy else "mapped",
                file_mapping, lock=file_locks.get(t.file_index),
            )  # fmt: skip
        else:
            buf, off, dev = dest_of[i]
            res.views[i] = buf.view(off, t.nbytes)
            branch: Branch
            if p.use_mmap:
                branch = "copy"
            elif buf.buffer_type.is_host:
                branch, file_mapping = "read", None
            elif dev.can_stage and buf.buffer_type is dev.default_buffer_type:
                branch, file_mapping = "staged", None
            else:
                branch, file_mapping = "sync", None
            job = TensorJob(
                i, t.name, t.ggml_type, t.file_index, path, t.offset, t.nbytes, branch, file_mapping,
                dest=buf, dest_offset=off, device=dev if branch in ("staged", "sync") else None,
                in_place=branch == "read" and i in in_place,
            )  # fmt: skip
        res.jobs.append(job)
    res.jobs = order_jobs(res.jobs, p)


def order_jobs(jobs: list[TensorJob], p: Plan) -> list[TensorJob]:
    """Load order: contexts in order (without mmap, device contexts before host ones);
    within a context, with mmap, file order; without, device tensors first: those
    uploaded through the staging buffers in buffer (file) order, so that neighbours in
    the file share staging buffers (biggest first only matters to a temporary buffer
    the size of the tensor), then those written synchronously, biggest first."""

    def on_device(job: TensorJob) -> bool:
        return job.dest is not None and not job.dest.buffer_type.is_host

    by_context: dict[tuple[bool, str], list[TensorJob]] = {}
    for job in jobs:
        by_context.setdefault(p.tensors[job.index].context, []).append(job)
    contexts = [by_context[k] for k in sorted(by_context)]
    if p.use_mmap:
        # in file order: neighbours in the file share an extent, and the pages come in
        # in the order the read-ahead brings them
        return [job for ctx in contexts for job in sorted(ctx, key=lambda j: (j.file_index, j.offset))]
    contexts.sort(key=lambda ctx: not any(on_device(j) for j in ctx))
    out: list[TensorJob] = []
    for ctx in contexts:
        # device tensors first; staged and host tensors in buffer (file) order, so runs
        # coalesce (a buffer allocated in pieces is filled in file order: offsets in
        # the pieces alone would interleave them); synchronous uploads biggest first
        # (their temporary buffers)
        out.extend(
            sorted(
                ctx,
                key=lambda j: (
                    not on_device(j),
                    j.branch == "sync",
                    (-j.nbytes, 0) if j.branch == "sync" else (j.file_index, j.offset),
                ),
            )
        )
    return out
