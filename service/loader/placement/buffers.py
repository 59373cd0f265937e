"""From placed tensors to buffers: one context per buffer type, wrapped file ranges under
mmap, allocations split at a device's largest allocation (llama.cpp's buffer creation in
``load_tensors`` and ``ggml_backend_alloc_ctx_tensors_from_buft``)."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from service.cancel import CancelToken, check
from service.errors import PlacementError
from service.io.align import align_up
from service.loader.devices import MAPPED_BUFFER_NAME, BufferType, Device
from service.loader.ranges import Range, merge_ranges, subtract_ranges
from service.loader.weights import WeightIndex

MiB = 1 << 20


class TensorPlacement(NamedTuple):
    """Where one tensor goes (a named tuple: a plan makes one per tensor, and a tuple is
    built several times faster than a frozen dataclass).

    Attributes:
        name: the tensor name.
        ggml_type: its ggml type name.
        nbytes: its size in bytes.
        file_index: the split holding its data.
        offset: absolute byte offset of its data in that file.
        layer: ``input``, ``blk.N`` or ``output``.
        layer_class: ``input``, ``repeating`` or ``output``.
        op: the op that consumes it.
        device: the device whose memory holds it.
        buffer_type: its buffer type (its context).
        role: ``weight``, or ``tied_output`` for the second copy of ``token_embd.weight``
            that serves as the output weight on a device.
        override: index of the ``-ot`` override that chose its buffer type, or None.
        lazy: read on demand: kept in its own CPU context, always mapped, not loaded.
    """

    name: str
    ggml_type: str
    nbytes: int
    file_index: int
    offset: int
    layer: str
    layer_class: str
    op: str
    device: str
    buffer_type: str
    role: str = "weight"
    override: int | None = None
    lazy: bool = False

    @property
    def context(self) -> tuple[bool, str]:
        """The context key: (lazy, buffer type); contexts sort by it."""
        return (self.lazy, self.buffer_type)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "type": self.ggml_type,
            "bytes": self.nbytes,
            "layer": self.layer,
            "layer_class": self.layer_class,
            "op": self.op,
            "device": self.device,
            "buffer_type": self.buffer_type,
            "role": self.role,
            "override": self.override,
            "lazy": self.lazy,
        }


RUN_ALIGNMENT = 4096
"""Alignment that host-buffer runs keep with the file (direct I/O block size)."""

DIRECT_RUN_MIN_NBYTES = 64 << 10
"""With direct I/O, a run of at least this many bytes gets the slack that lets its aligned
superset be read straight into the buffer; smaller runs are packed and go through the
bounce buffer, so that many small tensors do not cost a page or two each."""


@dataclass(frozen=True, slots=True)
class HostLayout:
    """Where tensors lie in a host buffer.

    Attributes:
        offsets: each tensor's offset in the buffer, in bytes.
        slack: each tensor's run has the room around it that direct reads need.
        nbytes: bytes to allocate.
    """

    offsets: tuple[int, ...]
    slack: tuple[bool, ...]
    nbytes: int


def host_layout(tensors: Sequence[TensorPlacement], alignment: int, *, direct: bool) -> HostLayout:
    """Offsets of ``tensors`` (in file order) in a host buffer, and the bytes to allocate.

    Tensors that follow each other in the file as they would in the buffer (same gap,
    the padding to ``alignment``) form a run, read with one call. Without direct I/O the
    tensors are packed as llama.cpp lays them out (each padded to ``alignment``): the
    allocation is the buffer's size. With direct I/O, each run of at least
    :data:`DIRECT_RUN_MIN_NBYTES` starts at an offset congruent to its file offset modulo
    :data:`RUN_ALIGNMENT`, with that much free space before it and after the last one, so
    that direct reads of its aligned superset go straight into the buffer without
    touching another run; smaller runs are packed. The buffer's size in the memory report
    stays llama.cpp's; only the allocation holds the slack.
    """
    a = RUN_ALIGNMENT
    runs: list[list[TensorPlacement]] = []
    for t in tensors:
        if runs:
            prev = runs[-1][-1]
            if t.file_index == prev.file_index and t.offset - prev.offset == align_up(prev.nbytes, alignment):
                runs[-1].append(t)
                continue
        runs.append([t])
    offsets: list[int] = []
    slack: list[bool] = []
    pos = 0
    spaced = False  # the previous run ends with slack after it
    for run in runs:
        size = sum(align_up(t.nbytes, alignment) for t in run)
        roomy = direct and size >= DIRECT_RUN_MIN_NBYTES
        if roomy:
            start = pos + (0 if spaced else a)
            start += (run[0].offset - start) % a
        else:
            start = pos
        at = start
        for t in run:
            offsets.append(at)
            slack.append(roomy)
            at += align_up(t.nbytes, alignment)
        pos = at + (a if roomy else 0)
        spaced = roomy
    return HostLayout(tuple(offsets), tuple(slack), pos)


@dataclass(frozen=True, slots=True)
class BufferPlan:
    """One model buffer.

    Attributes:
        name: the name llama.cpp prints (``CPU_Mapped`` for a wrapped file range, else
            the buffer type's name).
        buffer_type: the buffer type of its context.
        device: the device that owns the buffer type.
        memory: where its bytes live: the owning device, or ``CPU`` for host buffers.
        nbytes: its size in bytes.
        mapped: it wraps ``file_range`` of file ``file_index`` in the mapping.
        host: it lives in host memory.
        chunks: sizes of the allocations it is made of (several when the device's largest
            allocation is smaller than the buffer); ``(nbytes,)`` for a mapped buffer.
        lazy: it belongs to the context of lazily read tensors.
        tensors: indices into the plan's tensors of the tensors it holds.
        file_index: for a mapped buffer, the file; else None.
        file_range: for a mapped buffer, ``[start, end)`` in the file; else None.
        alloc_nbytes: bytes its allocations take (host buffers read with direct I/O hold
            slack around runs of tensors, see :func:`host_layout`); 0 for mapped buffers.
    """

    name: str
    buffer_type: str
    device: str
    memory: str
    nbytes: int
    mapped: bool
    host: bool
    chunks: tuple[int, ...]
    tensors: tuple[int, ...]
    file_index: int | None = None
    file_range: Range | None = None
    lazy: bool = False
    alloc_nbytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "lazy": self.lazy,
            "buffer_type": self.buffer_type,
            "device": self.device,
            "memory": self.memory,
            "bytes": self.nbytes,
            "mib": round(self.nbytes / MiB, 2),
            "mapped": self.mapped,
            "host": self.host,
            "alloc_bytes": self.alloc_nbytes,
            "chunks": list(self.chunks),
            "n_tensors": len(self.tensors),
            "file_index": self.file_index,
            "file_range": list(self.file_range) if self.file_range else None,
        }


def _chunks(
    buft: BufferType, members: Sequence[int], tensors: Sequence[TensorPlacement]
) -> tuple[tuple[int, ...], int]:
    """Allocation sizes of a context (tensors padded to the alignment, a new allocation
    whenever the next tensor would pass ``max_size``) and the total.

    Raises:
        PlacementError: a tensor larger than ``max_size``.
    """
    limit = buft.max_size
    sizes: list[int] = []
    cur = 0
    for i in members:
        t = tensors[i]
        size = align_up(t.nbytes, buft.alignment)
        if limit is not None and size > limit:
            raise PlacementError(
                f"tensor '{t.name}' is too large to fit in a {buft.name} buffer "
                f"(tensor size: {size} bytes, largest allocation: {limit} bytes)",
                tensor=t.name,
            )
        if limit is not None and cur and cur + size > limit:
            sizes.append(cur)
            cur = 0
        cur += size
    sizes.append(cur)
    return tuple(sizes), sum(sizes)


def build_buffers(
    index: WeightIndex,
    tensors: Sequence[TensorPlacement],
    bufts: dict[str, tuple[Device, BufferType]],
    *,
    use_mmap: bool,
    direct: bool = False,
    cancel: CancelToken | None = None,
) -> list[BufferPlan]:
    """The buffers of every context, in llama.cpp's order (contexts by (lazy, buffer type
    name); within a context, files in order and their ranges in order).

    Under mmap (and always for the lazy context), a context whose buffer type is its
    device's default and whose device can wrap host memory (the CPU) wraps the file
    ranges its tensors cover, minus the ranges of other contexts' tensors, merged
    (``get_mapping_ranges``): one ``CPU_Mapped`` buffer per range. Ranges separated only
    by the alignment padding after a tensor merge, since that padding belongs to no
    tensor. Other contexts are allocated. The work is linear in the tensors (and their
    ranges), checking ``cancel`` per file of each context.

    Raises:
        PlacementError: a tensor larger than its device's largest allocation.
        RequestAbandonedError, WorkLimitError: from ``cancel``.
    """
    members: dict[tuple[bool, str], list[int]] = {}
    by_file: dict[int, list[int]] = {}
    contexts = [t.context for t in tensors]
    file_order = [(t.file_index, t.offset) for t in tensors]  # each tensor's place in the files
    for i, t in enumerate(tensors):
        members.setdefault(contexts[i], []).append(i)
        by_file.setdefault(t.file_index, []).append(i)
    buffers: list[BufferPlan] = []
    for key in sorted(members):
        lazy, name = key
        dev, buft = bufts[name]
        # tensors lie in a buffer in file order, so that reads of neighbours coalesce
        own_idx = sorted(members[key], key=file_order.__getitem__)
        memory = "CPU" if buft.is_host else dev.name
        wraps = (use_mmap or lazy) and dev.caps.buffer_from_host_ptr and buft is dev.default_buffer_type
        if not wraps:
            chunks, total = _chunks(buft, own_idx, tensors)
            held = tuple(own_idx)
            alloc = total
            if buft.is_host and len(chunks) == 1:
                alloc = host_layout([tensors[i] for i in own_idx], buft.alignment, direct=direct).nbytes
            buffers.append(
                BufferPlan(
                    name, name, dev.name, memory, total, False, buft.is_host, chunks, held, lazy=lazy,
                    alloc_nbytes=alloc,
                )
            )  # fmt: skip
            continue
        own_by_file: dict[int, list[int]] = {}
        for i in own_idx:  # in offset order within each file
            own_by_file.setdefault(tensors[i].file_index, []).append(i)
        # a tensor placed twice (the tied output) is in this context's ranges by its other copy
        own_names = {tensors[i].name for i in own_idx} if len(members) > 1 else set()
        for file_index in sorted(own_by_file):
            check(cancel)
            in_file = own_by_file[file_index]
            starts = [tensors[i].offset for i in in_file]
            own = [(t.offset, t.offset + t.nbytes) for t in (tensors[i] for i in in_file) if t.nbytes]
            if not own:
                continue
            other = [
                (t.offset, t.offset + t.nbytes)
                for t in (tensors[j] for j in by_file[file_index] if contexts[j] != key)
                if t.name not in own_names and t.nbytes
            ]
            alignment = index.files[file_index].alignment
            ranges = subtract_ranges(merge_ranges(own, slack=alignment), merge_ranges(other, slack=1))
            # the ranges are disjoint and sorted, as the tensors are: each holds the
            # tensors that start in it
            for start, end in ranges:
                held = tuple(in_file[bisect_left(starts, start) : bisect_left(starts, end)])
                buffers.append(
                    BufferPlan(
                        MAPPED_BUFFER_NAME, name, dev.name, "CPU", end - start, True, True, (end - start,), held,
                        file_index, (start, end), lazy,
                    )
                )  # fmt: skip
    return buffers
