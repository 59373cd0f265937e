"""Moving tensor data into memory (llama.cpp's ``load_all_data``) on the host.

Two load modes:

- ``mmap``: the file is mapped read-only; each tensor is a zero-copy view into the
  mapping, held by ``CPU_Mapped`` buffers that wrap the mapped ranges the tensors cover.
  The pages are faulted in during the load (so the load does the I/O and reports it);
  afterwards the unused head and tail of each mapping are unmapped.
- ``none``: one ``CPU`` buffer is allocated and each tensor's bytes are read straight into
  its place with positioned reads.

Blocking work (reads, page faults) runs on one worker thread per load; the event loop
only receives progress. Cancelling the awaiting task, or returning ``False`` from the
progress callback, stops the worker at the next chunk and releases every buffer, mapping
and file descriptor the load took.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np

from service.errors import ByteOrderError, LoadCancelledError, RequestError
from service.io.align import align_up, aligned_empty
from service.io.file import open_readonly, pread_into
from service.io.mapping import Mapping
from service.loader.ggml_types import numpy_dtype, numpy_shape
from service.loader.model import BufferInfo, LoadedModel, LoadedTensor, MemoryReport
from service.loader.ranges import merge_ranges
from service.loader.weights import TensorWeight, WeightIndex

MiB = 1 << 20
DEFAULT_CHUNK_NBYTES = 16 * MiB
"""Bytes read or faulted in between two progress reports / cancellation checks."""

TENSOR_ALIGNMENT = 32
"""Alignment of each tensor inside an allocated host buffer (ggml's ``TENSOR_ALIGNMENT``)."""


class LoadMode(StrEnum):
    """How tensor data gets into memory (llama.cpp's ``-lm/--load-mode``)."""

    NONE = "none"
    MMAP = "mmap"

    @classmethod
    def parse(cls, value: str) -> LoadMode:
        """The load mode named ``value``. Raises :class:`RequestError` for an unknown name."""
        try:
            return cls(value)
        except ValueError:
            known = ", ".join(m.value for m in cls)
            raise RequestError(f"unknown load mode '{value}' (expected one of: {known})") from None


@dataclass(frozen=True, slots=True)
class Progress:
    """Progress of a load, in bytes of tensor data.

    Attributes:
        bytes_done: bytes in memory so far (monotonic).
        bytes_total: bytes the load will bring in.
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
    """Bring ``nbytes`` at ``offset`` of file ``path`` into memory: read them into
    ``dest``, or fault them in from ``mapping``."""

    path: str
    offset: int
    nbytes: int
    tensor: str
    dest: np.ndarray[Any, np.dtype[np.uint8]] | None = None
    mapping: Mapping | None = None


class _Resources:
    """What a load holds; released together on failure, cancellation or close.

    The tensor views and read steps live here too, so that releasing drops every
    reference to the buffers even while a traceback still holds the load's frames.
    """

    def __init__(self) -> None:
        self.mappings: list[Mapping] = []
        self.buffers: list[np.ndarray[Any, np.dtype[np.uint8]]] = []
        self.views: dict[str, np.ndarray[Any, Any]] = {}
        self.steps: list[_Step] = []

    def release(self) -> None:
        self.views.clear()
        self.steps.clear()
        self.buffers.clear()
        for mapping in self.mappings:
            mapping.close()
        self.mappings.clear()


def _tensor_view(raw: np.ndarray[Any, np.dtype[np.uint8]], weight: TensorWeight) -> np.ndarray[Any, Any]:
    info = weight.info
    return raw.view(numpy_dtype(info.ggml_type)).reshape(numpy_shape(info.ggml_type, info.ne))


def _layout_mmap(index: WeightIndex, res: _Resources) -> list[BufferInfo]:
    """Map each file, fill ``res.views`` and ``res.steps``; return the buffers."""
    views = res.views
    steps = res.steps
    buffers: list[BufferInfo] = []
    for file_index, gguf_file in enumerate(index.files):
        weights = [w for w in index.weights.values() if w.file_index == file_index]
        if not weights:
            continue
        mapping = Mapping(gguf_file.path)
        res.mappings.append(mapping)
        for start, end in merge_ranges(((w.offset, w.end) for w in weights), slack=gguf_file.alignment):
            buffers.append(BufferInfo("CPU_Mapped", "CPU", end - start, mapped=True, host=True))
        for w in sorted(weights, key=lambda w: w.offset):
            views[w.name] = _tensor_view(mapping.array(w.offset, w.nbytes), w)
            steps.append(_Step(gguf_file.path, w.offset, w.nbytes, w.name, mapping=mapping))
    return buffers


def _layout_none(index: WeightIndex, res: _Resources) -> list[BufferInfo]:
    """Allocate one host buffer, fill ``res.views`` and ``res.steps``; return the buffers."""
    ordered = sorted(index.weights.values(), key=lambda w: (w.file_index, w.offset))
    total = sum(align_up(w.nbytes, TENSOR_ALIGNMENT) for w in ordered)
    res.buffers.append(aligned_empty(total))
    pos = 0
    for w in ordered:
        dest = res.buffers[0][pos : pos + w.nbytes]
        res.views[w.name] = _tensor_view(dest, w)
        res.steps.append(_Step(index.files[w.file_index].path, w.offset, w.nbytes, w.name, dest=dest))
        pos += align_up(w.nbytes, TENSOR_ALIGNMENT)
    return [BufferInfo("CPU", "CPU", total, mapped=False, host=True)] if ordered else []


def _run_steps(
    steps: list[_Step],
    chunk_nbytes: int,
    cancel: threading.Event,
    report: Callable[[int], None],
) -> None:
    """Worker thread body: perform ``steps`` chunk by chunk, reporting bytes done."""
    fds: dict[str, int] = {}
    try:
        for step in steps:
            done = 0
            while done < step.nbytes:
                if cancel.is_set():
                    return
                n = min(chunk_nbytes, step.nbytes - done)
                if step.mapping is not None:
                    step.mapping.populate(step.offset + done, n)
                else:
                    assert step.dest is not None
                    fd = fds.get(step.path)
                    if fd is None:
                        fd = fds[step.path] = open_readonly(step.path)
                    pread_into(
                        fd, step.dest[done : done + n].data, step.offset + done, path=step.path, tensor=step.tensor
                    )
                done += n
                report(n)
    finally:
        for fd in fds.values():
            os.close(fd)


async def load_model(
    index: WeightIndex,
    *,
    load_mode: LoadMode | str = LoadMode.MMAP,
    on_progress: ProgressCallback | None = None,
    chunk_nbytes: int = DEFAULT_CHUNK_NBYTES,
) -> LoadedModel:
    """Load every tensor of ``index`` into host memory (llama.cpp ``load_all_data``).

    Args:
        index: the model's weights index.
        load_mode: ``mmap`` (zero-copy views of a file mapping, ``CPU_Mapped`` buffers) or
            ``none`` (read into an allocated ``CPU`` buffer).
        on_progress: called on the event loop with :class:`Progress` after each chunk,
            with bytes done strictly increasing; returning ``False`` cancels the load.
        chunk_nbytes: bytes moved between two progress reports (and cancellation checks).

    Returns:
        The :class:`LoadedModel`; the caller closes it.

    Raises:
        RequestError: unknown load mode.
        ByteOrderError: the file is big-endian.
        StorageError: a file cannot be opened, mapped or read.
        LoadCancelledError: the progress callback returned ``False``.
        asyncio.CancelledError: the awaiting task was cancelled.
        In every case nothing the load took stays held.
    """
    mode = LoadMode.parse(load_mode) if isinstance(load_mode, str) else load_mode
    if index.byte_order != "little":
        raise ByteOrderError(
            "the file is big-endian; hoist loads little-endian tensor data only",
            path=index.path,
            hint="convert it with gguf-py's `gguf-convert-endian FILE little`",
        )
    res = _Resources()
    try:
        buffers = (_layout_mmap if mode is LoadMode.MMAP else _layout_none)(index, res)
        total = sum(s.nbytes for s in res.steps)
        cancelled_by_callback = await _run_worker(res.steps, total, chunk_nbytes, on_progress)
        if cancelled_by_callback:
            raise LoadCancelledError("the load was cancelled by its progress callback", path=index.path)
        if mode is LoadMode.MMAP:
            _unmap_unused(index, res.mappings)
        tensors = {
            name: LoadedTensor(
                name=name,
                ggml_type=w.info.ggml_type.name,
                ne=w.info.ne,
                nbytes=w.nbytes,
                buffer_type="CPU_Mapped" if mode is LoadMode.MMAP else "CPU",
                device="CPU",
                data=res.views[name],
            )
            for name, w in index.weights.items()
        }
    except BaseException:
        res.release()
        raise
    res.steps.clear()
    return LoadedModel(index, mode.value, tensors, MemoryReport(tuple(buffers)), res.release)


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


def _unmap_unused(index: WeightIndex, mappings: list[Mapping]) -> None:
    """Unmap each mapping's head and tail that no tensor uses (page-aligned inward)."""
    by_path = {m.path: m for m in mappings}
    for file_index, gguf_file in enumerate(index.files):
        mapping = by_path.get(gguf_file.path)
        if mapping is None:
            continue
        used = [(w.offset, w.end) for w in index.weights.values() if w.file_index == file_index]
        first = min(start for start, _ in used)
        last = max(end for _, end in used)
        mapping.unmap_fragment(0, first)
        if last:
            mapping.unmap_fragment(last, mapping.size)
