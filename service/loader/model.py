"""A loaded model: its tensors, the buffers holding them, and the memory report."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.io.mapping import Mapping
from service.loader.placement import Plan
from service.loader.weights import WeightIndex

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class BufferInfo:
    """One model buffer (llama.cpp's ``ggml_backend_buffer`` holding weights).

    Attributes:
        buffer_type: the buffer type's name (``CPU``, ``CPU_Mapped``, ...).
        device: the device whose memory holds it (``CPU``, ...).
        nbytes: the buffer's size in bytes.
        mapped: True when the buffer wraps a range of a file mapping.
        host: True when the buffer lives in host memory.
    """

    buffer_type: str
    device: str
    nbytes: int
    mapped: bool
    host: bool

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (bytes, and MiB for reading)."""
        return {
            "buffer_type": self.buffer_type,
            "device": self.device,
            "bytes": self.nbytes,
            "mib": round(self.nbytes / MiB, 2),
            "mapped": self.mapped,
            "host": self.host,
        }


@dataclass(frozen=True, slots=True)
class MemoryReport:
    """The model buffers of a load, in the order llama.cpp prints them.

    Attributes:
        buffers: one entry per buffer.
    """

    buffers: tuple[BufferInfo, ...]

    @property
    def total_nbytes(self) -> int:
        """Bytes over all buffers."""
        return sum(b.nbytes for b in self.buffers)

    def by_device(self) -> dict[str, dict[str, int]]:
        """Bytes per device, then per buffer type: ``{device: {buffer_type: bytes}}``."""
        out: dict[str, dict[str, int]] = {}
        for b in self.buffers:
            per_type = out.setdefault(b.device, {})
            per_type[b.buffer_type] = per_type.get(b.buffer_type, 0) + b.nbytes
        return out

    def lines(self) -> list[str]:
        """llama.cpp's report lines: ``%12s model buffer size = %8.2f MiB`` per buffer."""
        return [f"{b.buffer_type:>12} model buffer size = {b.nbytes / MiB:8.2f} MiB" for b in self.buffers]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form: every buffer, totals per device and buffer type, and the lines."""
        return {
            "buffers": [b.to_dict() for b in self.buffers],
            "by_device": self.by_device(),
            "total_bytes": self.total_nbytes,
            "lines": self.lines(),
        }


@dataclass(slots=True)
class LoadedTensor:
    """One tensor of a loaded model.

    Attributes:
        name: the tensor name.
        ggml_type: the ggml type name (``F32``, ``Q4_K``, ...).
        ne: dimensions in ggml order (``ne[0]`` is the row length).
        nbytes: size of the data in bytes.
        buffer_type: the buffer holding it (``CPU_Mapped``, ``CPU``, ``EMU0``, ...).
        device: the device whose memory holds it.
        data: the data. On the host and on emulated devices a numpy array: the element
            type for plain types (``F32`` as float32, ``BF16`` as its uint16 patterns),
            raw ``uint8`` rows of blocks for block-quantized types; shape ``ne`` reversed
            (for quantized types the last axis is the row's bytes). On a CUDA device a
            ``torch.uint8`` tensor of the raw bytes. SAFETY: valid until the model is
            closed; under ``mmap`` a read-only view of the file mapping.
        lazy: read on demand: ``data`` is a view of the file mapping whose pages are read
            from disk when first touched.
    """

    name: str
    ggml_type: str
    ne: tuple[int, ...]
    nbytes: int
    buffer_type: str
    device: str
    data: np.ndarray[Any, np.dtype[Any]]
    lazy: bool = False


class LoadedModel:
    """Weights resident on their devices, with what holds them.

    A model owns its buffers and file mappings; :meth:`close` releases them (also on
    ``with`` exit). After closing, tensor arrays obtained earlier must not be used.

    Attributes:
        index: the weights index the model was loaded from.
        plan: the placement it was loaded with.
        load_mode: the load mode in effect (``auto`` resolved: ``mmap``, ``none``,
            ``mlock``, ``mmap+mlock``, ``direct-io``).
        tensors: name -> :class:`LoadedTensor`, in load order.
        tied_output: the second copy of ``token_embd.weight`` that serves as the output
            weight on a device (models without ``output.weight``), if any.
        report: the memory report.
        warnings: what the user should know (mlock limits, direct I/O fallbacks, ...).
        stats: how the bytes moved (:class:`~service.loader.pipeline.stats.WorkerStats`: bytes
            per branch, staging pools, direct I/O, bytes from the page cache and from disk,
            busy time per stage and the stage that bounded the load).
        tensor_hashes: with hash-tensors, tensor name -> hex xxh3_64 digest (16 digits,
            ``xxhash.xxh3_64(data).hexdigest()``) of its bytes as the file holds them, in
            load order; empty otherwise.
    """

    def __init__(
        self,
        index: WeightIndex,
        plan: Plan,
        tensors: dict[str, LoadedTensor],
        report: MemoryReport,
        release: Callable[[], None],
        *,
        tied_output: LoadedTensor | None = None,
        warnings: list[str] | None = None,
        stats: Any = None,
        mappings: Sequence[Mapping] = (),
        tensor_hashes: dict[str, str] | None = None,
    ) -> None:
        self.index = index
        self.plan = plan
        self.load_mode = plan.effective_load_mode.value
        self.tensors = tensors
        self.tied_output = tied_output
        self.report = report
        self.warnings = list(warnings or [])
        self.stats = stats
        self.tensor_hashes = dict(tensor_hashes or {})
        self._mappings = list(mappings)
        self._release: Callable[[], None] | None = release

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has run."""
        return self._release is None

    def changed_files(self) -> list[tuple[str, str]]:
        """The mapped files that changed since they were mapped, as (path, how).

        ``CPU_Mapped`` and lazy tensors are views of their file: if it shrinks, reading
        the pages past its new end raises SIGBUS, which kills the process; if it is
        rewritten in place, the tensors change. Check this before reading mapped tensors
        of a file others may write, and close the model when it is not empty. Empty
        once the model is closed.
        """
        out = []
        for mapping in self._mappings:
            how = mapping.changed()
            if how is not None:
                out.append((mapping.path, how))
        return out

    def close(self) -> None:
        """Release every buffer and mapping the model holds. Idempotent."""
        release, self._release = self._release, None
        if release is None:
            return
        self._mappings = []
        for tensor in self.tensors.values():
            tensor.data = np.empty(0, dtype=np.uint8)
        if self.tied_output is not None:
            self.tied_output.data = np.empty(0, dtype=np.uint8)
        release()

    def __iter__(self) -> Iterator[LoadedTensor]:
        return iter(self.tensors.values())

    def __len__(self) -> int:
        return len(self.tensors)

    def __getitem__(self, name: str) -> LoadedTensor:
        return self.tensors[name]

    def __enter__(self) -> LoadedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
