"""Moving tensor data to where a plan puts it (llama.cpp's buffer creation and
``load_all_data``).

Buffers come from the plan: ``CPU_Mapped`` buffers wrap ranges of a read-only file
mapping (each tensor in them is a zero-copy view; its pages are faulted in during the
load, so the load does the I/O and reports it); other buffers are allocated on their
device. Each tensor then takes one of these paths:

- mapped: fault its pages in (zero copy);
- read: without mmap, read its bytes straight into its host buffer;
- copy: under mmap, copy its bytes from the mapping into its (device) buffer;
- stage: without mmap, read its bytes into a host staging buffer and upload them.

Without mmap, device tensors load first, biggest first (their staging is cheapest while
the fewest weights are resident). After an mmap load, the head and tail of each mapping
that no zero-copy tensor uses are unmapped.

Blocking work runs on one worker thread per load; the event loop only receives
progress. Cancelling the awaiting task, or returning ``False`` from the progress
callback, stops the worker at the next chunk and releases every buffer, mapping and file
descriptor the load took.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.errors import BudgetExceededError, ByteOrderError, LoadCancelledError, RequestError, StorageError
from service.io.align import align_up, aligned_empty
from service.io.file import open_readonly, pread_into
from service.io.mapping import Mapping
from service.loader.devices import MAPPED_BUFFER_NAME, CPUDevice, Device, DeviceBuffer
from service.loader.ggml_types import GGML_TYPES_BY_NAME, numpy_dtype, numpy_shape
from service.loader.model import BufferInfo, LoadedModel, LoadedTensor, MemoryReport
from service.loader.placement import LoadMode, PlacementParams, Plan, TensorPlacement, plan
from service.loader.weights import WeightIndex

MiB = 1 << 20
DEFAULT_CHUNK_NBYTES = 16 * MiB
"""Bytes read or faulted in between two progress reports / cancellation checks."""

STAGING_NBYTES = 1 * MiB
"""Size of the host staging buffer for device uploads without mmap."""

IMPLEMENTED_LOAD_MODES = (LoadMode.AUTO, LoadMode.MMAP, LoadMode.NONE)


@dataclass(frozen=True, slots=True)
class Progress:
    """Progress of a load, in bytes of tensor data.

    Attributes:
        bytes_done: bytes in place so far (monotonic).
        bytes_total: bytes the load brings in (a tensor loaded to two buffers counts twice).
    """

    bytes_done: int
    bytes_total: int

    @property
    def fraction(self) -> float:
        """``bytes_done / bytes_total`` (1.0 for an empty model)."""
        return self.bytes_done / self.bytes_total if self.bytes_total else 1.0


ProgressCallback = Callable[[Progress], bool | None]
"""Called on the event loop after each chunk; returning ``False`` cancels the load."""


@dataclass(frozen=True, slots=True)
class _Step:
    """Bring one tensor's ``nbytes`` at ``offset`` of file ``path`` to its place."""

    tensor: str
    file_index: int
    path: str
    offset: int
    nbytes: int
    mapping: Mapping | None
    dest: DeviceBuffer | None
    dest_offset: int


class _Resources:
    """What a load holds; released together on failure, cancellation or close.

    The tensor views and steps live here too, so that releasing drops every reference
    to the buffers even while a traceback still holds the load's frames.
    """

    def __init__(self) -> None:
        self.mappings: dict[int, Mapping] = {}
        self.buffers: list[DeviceBuffer] = []
        self.views: dict[int, Any] = {}
        self.mapped: set[int] = set()
        self.steps: list[_Step] = []

    def release(self) -> None:
        self.views.clear()
        self.mapped.clear()
        self.steps.clear()
        for buf in self.buffers:
            buf.free()
        self.buffers.clear()
        for mapping in self.mappings.values():
            mapping.close()
        self.mappings.clear()


def _typed(raw: Any, t: TensorPlacement, ne: tuple[int, ...]) -> Any:
    """A numpy ``uint8`` view as the tensor's element type and shape; other array types
    (torch tensors on a GPU) stay raw bytes."""
    if not isinstance(raw, np.ndarray):
        return raw
    ggml_type = GGML_TYPES_BY_NAME[t.ggml_type]
    return raw.view(numpy_dtype(ggml_type)).reshape(numpy_shape(ggml_type, ne))


def check_budget(p: Plan) -> None:
    """Raise :class:`BudgetExceededError` with the per-device breakdown unless every
    device's free memory holds what ``p`` allocates there."""
    if p.fits:
        return
    parts = [
        f"{u.device} needs {u.allocated / MiB:.2f} MiB, {u.free / MiB:.2f} MiB free" for u in p.device_use if not u.fits
    ]
    raise BudgetExceededError(
        "the model does not fit: " + "; ".join(parts),
        path=p.model,
        hint="offload fewer layers (-ngl), change --tensor-split, or free memory",
    )


def _layout(index: WeightIndex, p: Plan, devices: Sequence[Device], res: _Resources) -> None:
    """Map the files, allocate the buffers, and fill ``res.views`` (placement index ->
    raw view) and ``res.steps``."""
    by_name = {d.name: d for d in devices}
    for b in p.buffers:
        if b.mapped:
            continue
        dev = by_name[b.device]
        buft = next(bt for bt in dev.buffer_types() if bt.name == b.buffer_type)
        offsets: list[tuple[DeviceBuffer, int]] = []
        chunk_iter = iter(b.chunks)
        buf = dev.alloc(buft, next(chunk_iter))
        res.buffers.append(buf)
        pos = 0
        for i in b.tensors:
            size = align_up(p.tensors[i].nbytes, buft.alignment)
            if pos + size > buf.nbytes and pos:
                buf = dev.alloc(buft, next(chunk_iter))
                res.buffers.append(buf)
                pos = 0
            offsets.append((buf, pos))
            pos += size
        for i, (buf, off) in zip(b.tensors, offsets, strict=True):
            t = p.tensors[i]
            res.views[i] = buf.view(off, t.nbytes)
            path = index.files[t.file_index].path
            res.steps.append(_Step(t.name, t.file_index, path, t.offset, t.nbytes, None, buf, off))
    if p.use_mmap:
        for file_index, gguf_file in enumerate(index.files):
            if any(t.file_index == file_index for t in p.tensors):
                mapping = res.mappings[file_index] = Mapping(gguf_file.path)
                if mapping.size != gguf_file.file_size:
                    raise StorageError(
                        f"the file changed since its header was read: {gguf_file.file_size} bytes then, "
                        f"{mapping.size} now",
                        path=gguf_file.path,
                    )
        res.steps = [
            _Step(s.tensor, s.file_index, s.path, s.offset, s.nbytes, res.mappings[s.file_index], s.dest, s.dest_offset)
            for s in res.steps
        ]
        for i, t in enumerate(p.tensors):
            if i not in res.views:
                mapping = res.mappings[t.file_index]
                res.views[i] = mapping.array(t.offset, t.nbytes)
                res.mapped.add(i)
                res.steps.append(_Step(t.name, t.file_index, mapping.path, t.offset, t.nbytes, mapping, None, 0))
        res.steps.sort(key=lambda s: (s.file_index, s.offset))
    else:
        # device tensors first, biggest first; then host tensors in file order
        res.steps.sort(key=lambda s: (s.dest is None or _is_host(s.dest), -s.nbytes if not _is_host(s.dest) else 0))


def _is_host(buf: DeviceBuffer | None) -> bool:
    return buf is None or buf.buffer_type.is_host


def _run_steps(
    steps: list[_Step],
    chunk_nbytes: int,
    cancel: threading.Event,
    report: Callable[[int], None],
) -> None:
    """Worker thread body: perform ``steps`` chunk by chunk, reporting bytes done."""
    fds: dict[str, int] = {}
    staging: np.ndarray[Any, np.dtype[np.uint8]] | None = None
    try:
        for step in steps:
            done = 0
            while done < step.nbytes:
                if cancel.is_set():
                    return
                n = min(chunk_nbytes, step.nbytes - done)
                at = step.offset + done
                if step.mapping is not None:
                    step.mapping.populate(at, n)
                    if step.dest is not None:
                        step.dest.write(step.dest_offset + done, step.mapping.array(at, n))
                else:
                    assert step.dest is not None
                    fd = fds.get(step.path)
                    if fd is None:
                        fd = fds[step.path] = open_readonly(step.path)
                    if step.dest.buffer_type.is_host:
                        view = step.dest.view(step.dest_offset + done, n)
                        pread_into(fd, view.data, at, path=step.path, tensor=step.tensor)
                    else:
                        n = min(n, STAGING_NBYTES)
                        if staging is None:
                            staging = aligned_empty(STAGING_NBYTES)
                        pread_into(fd, staging[:n].data, at, path=step.path, tensor=step.tensor)
                        step.dest.write(step.dest_offset + done, staging[:n])
                done += n
                report(n)
    finally:
        for fd in fds.values():
            os.close(fd)


async def load_model(
    index: WeightIndex,
    *,
    load_mode: LoadMode | str = LoadMode.MMAP,
    devices: Sequence[Device] | None = None,
    params: PlacementParams | None = None,
    on_progress: ProgressCallback | None = None,
    chunk_nbytes: int = DEFAULT_CHUNK_NBYTES,
) -> LoadedModel:
    """Place and load every tensor of ``index`` (llama.cpp ``load_tensors`` +
    ``load_all_data``).

    Args:
        index: the model's weights index.
        load_mode: ``mmap`` (zero-copy views of a file mapping for CPU tensors),
            ``none`` (read into allocated buffers) or ``auto``; ignored when ``params``
            is given (its ``load_mode`` counts).
        devices: the devices to place on (default: the CPU alone).
        params: the placement flags (default: every layer offloaded, layer split).
        on_progress: called on the event loop with :class:`Progress` after each chunk,
            with bytes done strictly increasing; returning ``False`` cancels the load.
        chunk_nbytes: bytes moved between two progress reports (and cancellation checks).

    Returns:
        The :class:`LoadedModel`; the caller closes it.

    Raises:
        RequestError: unknown or unsupported load mode.
        ByteOrderError: the file is big-endian.
        PlacementError: the flags give no valid placement.
        BudgetExceededError: the plan needs more memory than a device has free; nothing
            was allocated.
        OutOfMemoryError: an allocation failed.
        StorageError: a file cannot be opened, mapped or read.
        LoadCancelledError: the progress callback returned ``False``.
        asyncio.CancelledError: the awaiting task was cancelled.
        In every case nothing the load took stays held.
    """
    if params is None:
        mode = LoadMode.parse(load_mode) if isinstance(load_mode, str) else load_mode
        params = PlacementParams(load_mode=mode)
    if params.load_mode not in IMPLEMENTED_LOAD_MODES:
        raise RequestError(f"load mode '{params.load_mode.value}' is not available for loading yet; use mmap or none")
    if index.byte_order != "little":
        raise ByteOrderError(
            "the file is big-endian; hoist loads little-endian tensor data only",
            path=index.path,
            hint="convert it with gguf-py's `gguf-convert-endian FILE little`",
        )
    devices = list(devices) if devices is not None else [CPUDevice()]
    placement = plan(index, devices, params)
    check_budget(placement)
    return await load_plan(index, placement, devices, on_progress=on_progress, chunk_nbytes=chunk_nbytes)


async def load_plan(
    index: WeightIndex,
    placement: Plan,
    devices: Sequence[Device],
    *,
    on_progress: ProgressCallback | None = None,
    chunk_nbytes: int = DEFAULT_CHUNK_NBYTES,
) -> LoadedModel:
    """Load ``index`` as ``placement`` (from :func:`~service.loader.placement.plan`) says.

    Raises: as :func:`load_model`, but the plan is taken as it is (no budget check).
    """
    res = _Resources()
    try:
        _layout(index, placement, devices, res)
        total = sum(s.nbytes for s in res.steps)
        cancelled_by_callback = await _run_worker(res.steps, total, chunk_nbytes, on_progress)
        if cancelled_by_callback:
            raise LoadCancelledError("the load was cancelled by its progress callback", path=index.path)
        if placement.use_mmap:
            _unmap_unused(placement, res.mappings)
        tensors: dict[str, LoadedTensor] = {}
        tied: LoadedTensor | None = None
        for i, t in enumerate(placement.tensors):
            w = index.weights[t.name]
            loaded = LoadedTensor(
                name=t.name,
                ggml_type=t.ggml_type,
                ne=w.info.ne,
                nbytes=t.nbytes,
                buffer_type=MAPPED_BUFFER_NAME if i in res.mapped else t.buffer_type,
                device=t.device,
                data=_typed(res.views[i], t, w.info.ne),
            )
            if t.role == "tied_output":
                tied = loaded
            else:
                tensors[t.name] = loaded
    except BaseException:
        res.release()
        raise
    res.steps.clear()
    report = MemoryReport(
        tuple(BufferInfo(b.name, b.memory, b.nbytes, mapped=b.mapped, host=b.host) for b in placement.buffers)
    )
    return LoadedModel(index, placement, tensors, report, res.release, tied_output=tied)


async def _run_worker(steps: list[_Step], total: int, chunk_nbytes: int, on_progress: ProgressCallback | None) -> bool:
    """Run ``steps`` on a worker thread; returns True when the callback cancelled.

    On task cancellation the worker is told to stop and awaited before the
    ``CancelledError`` propagates, so nothing is released while it still runs.
    """
    loop = asyncio.get_running_loop()
    cancel = threading.Event()
    done_future: asyncio.Future[None] = loop.create_future()
    state = {"done": 0, "by_callback": False}

    def deliver(n: int) -> None:
        state["done"] += n
        if on_progress is not None and not cancel.is_set():
            if on_progress(Progress(state["done"], total)) is False:
                state["by_callback"] = True
                cancel.set()

    def finish(exc: BaseException | None) -> None:
        if done_future.done():
            return
        if exc is None:
            done_future.set_result(None)
        else:
            done_future.set_exception(exc)

    def body() -> None:
        error: BaseException | None = None
        try:

            def report(n: int) -> None:
                loop.call_soon_threadsafe(deliver, n)

            _run_steps(steps, chunk_nbytes, cancel, report)
        except BaseException as exc:  # handed to the awaiting task
            error = exc
        loop.call_soon_threadsafe(finish, error)

    if on_progress is not None:
        on_progress(Progress(0, total))
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
        # the worker has posted its result; it is at most returning now
        thread.join()
    return bool(state["by_callback"])


def _unmap_unused(placement: Plan, mappings: dict[int, Mapping]) -> None:
    """Unmap each mapping's head and tail that no zero-copy tensor uses (page-aligned
    inward); a mapping no zero-copy tensor uses is unmapped entirely."""
    for file_index, mapping in mappings.items():
        used = [
            (placement.tensors[i].offset, placement.tensors[i].offset + placement.tensors[i].nbytes)
            for b in placement.buffers
            if b.mapped and b.file_index == file_index
            for i in b.tensors
        ]
        if not used:
            mapping.unmap_fragment(0, mapping.size)
            continue
        mapping.unmap_fragment(0, min(s for s, _ in used))
        mapping.unmap_fragment(max(e for _, e in used), mapping.size)
