"""What every device offers (llama.cpp's ``ggml_backend_dev`` and buffer types)."""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from service.io.align import LARGE_BUFFER
from service.io.buffer_cache import HOST_BUFFER_CACHE, size_class
from service.io.meter import HOST_MEMORY, MemoryMeter

if TYPE_CHECKING:  # numpy is imported with the first buffer, not with the devices
    import numpy as np

    from service.io.touch import TouchAhead


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """A device's memory, in bytes.

    Attributes:
        free: bytes available for new buffers now.
        total: bytes the device has in all.
    """

    free: int
    total: int


@dataclass(frozen=True, slots=True)
class DeviceCaps:
    """Capabilities (llama.cpp's ``ggml_backend_dev_caps``).

    Attributes:
        async_: copies can run asynchronously (streams / a worker).
        host_buffer: the device has a pinned host buffer type for staging.
        buffer_from_host_ptr: the device can wrap host memory (a file mapping) as a buffer.
        events: the device can record and wait on events.
        mmap_support: the device can load from a file mapping.
    """

    async_: bool
    host_buffer: bool
    buffer_from_host_ptr: bool
    events: bool
    mmap_support: bool = True

    def to_dict(self) -> dict[str, bool]:
        return {
            "async": self.async_,
            "host_buffer": self.host_buffer,
            "buffer_from_host_ptr": self.buffer_from_host_ptr,
            "events": self.events,
            "mmap_support": self.mmap_support,
        }


@dataclass(frozen=True, slots=True)
class BufferType:
    """A buffer type (llama.cpp's ``ggml_backend_buffer_type``).

    Attributes:
        name: the buffer type's name (``CPU``, ``EMU0``, ``EMU_Host``, ``CUDA0``, ...).
        device: name of the device that owns it.
        is_host: buffers of this type live in host memory.
        alignment: alignment of each tensor in an allocated buffer, in bytes.
        max_size: largest single buffer in bytes (None: no limit).
    """

    name: str
    device: str
    is_host: bool
    alignment: int = 32
    max_size: int | None = None


class Event(ABC):
    """Completion of work queued on a stream (llama.cpp's ``ggml_backend_event``)."""

    done_at: float | None = None
    """``time.perf_counter()`` when the work completed, on streams that stamp their
    events (:attr:`Stream.stamps_events`); None until then, and on other streams."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block until the work recorded by this event is done; re-raises its error."""

    @abstractmethod
    def query(self) -> bool:
        """True when the work is done."""


class Stream(ABC):
    """An ordered queue of asynchronous copies to one device (a CUDA stream; a worker
    thread for emulated devices). Owned by one load; closed when it ends."""

    stamps_events: bool = False
    """Its events record when they complete (:attr:`Event.done_at`), so that uploads can
    be timed afterwards without a thread waiting for each event."""

    @abstractmethod
    def upload(self, dest: DeviceBuffer, dest_offset: int, src: DeviceBuffer, src_offset: int, nbytes: int) -> Event:
        """Queue a copy of ``nbytes`` from host buffer ``src`` (a staging buffer of the
        device's host buffer type) to ``dest``; returns the event that completes with it.
        ``src`` must not be written again before the event completes."""

    @abstractmethod
    def close(self) -> None:
        """Wait for queued copies and release the stream. Idempotent."""

    def abort(self) -> None:
        """Drop copies not started yet (their events complete with an error) so that a
        cancelled load does not wait for them; by default, wait for them."""
        return None


class DeviceBuffer(ABC):
    """Memory allocated on a device for a buffer of some buffer type.

    Attributes:
        buffer_type: the buffer's type.
        nbytes: its size in bytes.
    """

    buffer_type: BufferType
    nbytes: int
    _release_hooks: list[Callable[[], None]] | None = None
    _guard: AbstractContextManager[Any] | None = None

    def on_release(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` once when the buffer is freed."""
        if self._release_hooks is None:
            self._release_hooks = []
        self._release_hooks.append(hook)

    def _released(self) -> None:
        """Run the release hooks (subclasses call this from :meth:`free`, once)."""
        hooks, self._release_hooks = self._release_hooks, None
        for hook in hooks or ():
            hook()

    @abstractmethod
    def write(self, offset: int, data: np.ndarray[Any, np.dtype[np.uint8]]) -> None:
        """Copy ``data`` (host bytes) to ``[offset, offset + len(data))`` of the buffer."""

    @abstractmethod
    def view(self, offset: int, nbytes: int) -> Any:
        """The bytes ``[offset, offset + nbytes)`` as the device's array type: a numpy
        ``uint8`` array for host and emulated memory, a torch tensor on CUDA."""

    @abstractmethod
    def read(self, offset: int, nbytes: int) -> bytes:
        """Copy ``nbytes`` at ``offset`` back to the host."""

    def free(self) -> None:
        """Release the memory. Idempotent."""
        with self._guard or nullcontext():
            self._free()

    @abstractmethod
    def _free(self) -> None:
        """Release the memory and run the release hooks, once (the device's own work;
        :meth:`free` calls it under the device's guard)."""


class ArrayBuffer(DeviceBuffer):
    """A buffer whose memory is a numpy array: host memory, pinned host memory, or the
    memory of an emulated device.

    Args:
        buffer_type: its buffer type.
        data: its memory (``uint8``).
        on_free: called once when the buffer is freed (to return device memory).
    """

    def __init__(
        self,
        buffer_type: BufferType,
        data: np.ndarray[Any, np.dtype[np.uint8]],
        on_free: Callable[[], None] | None = None,
    ) -> None:
        self.buffer_type = buffer_type
        self.nbytes = len(data)
        self._data: np.ndarray[Any, np.dtype[np.uint8]] | None = data
        self._on_free = on_free

    @property
    def data(self) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """The whole buffer. Raises RuntimeError once freed."""
        if self._data is None:
            raise RuntimeError(f"{self.buffer_type.name} buffer already freed")
        return self._data

    def write(self, offset: int, data: np.ndarray[Any, np.dtype[np.uint8]]) -> None:
        self.data[offset : offset + len(data)] = data

    def view(self, offset: int, nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        return self.data[offset : offset + nbytes]

    def read(self, offset: int, nbytes: int) -> bytes:
        return self.data[offset : offset + nbytes].tobytes()

    def _free(self) -> None:
        if self._data is not None:
            self._data = None
            if self._on_free is not None:
                self._on_free()
            self._released()


class HostBuffer(ArrayBuffer):
    """A buffer in host memory (the ``CPU`` buffer type, or a device's host buffer type),
    aligned to 4096 bytes; a large one is placed and first touched as the host buffer
    policy says (:func:`service.io.touch.host_array`: huge pages, pages faulted in by a
    helper thread while it is filled), or is a freed one of the same size class taken
    from :data:`~service.io.buffer_cache.HOST_BUFFER_CACHE` (pages touched already, bytes
    of its last load still in it), and goes back there when freed unless a view of it is
    still alive."""

    def __init__(self, buffer_type: BufferType, nbytes: int) -> None:
        from service.io.touch import host_array

        cache = HOST_BUFFER_CACHE
        toucher: TouchAhead | None = None
        whole = cache.take(nbytes) if nbytes >= LARGE_BUFFER and cache.cap else None
        self.reused = whole is not None
        """The memory came from the cache (it holds a previous buffer's bytes)."""
        if whole is None:
            whole, toucher = host_array(size_class(nbytes) if nbytes >= LARGE_BUFFER else nbytes)
        self._toucher = toucher
        self._whole: np.ndarray[Any, np.dtype[np.uint8]] | None = whole if nbytes >= LARGE_BUFFER else None
        super().__init__(buffer_type, whole[:nbytes])

    def reads_reached(self, offset: int) -> None:
        """The reads filling the buffer have started on every byte before ``offset``: the
        touch helper, if any, goes on from there (pages before it fault in as the reads
        write them)."""
        if self._toucher is not None:
            self._toucher.advance(offset)

    def _free(self) -> None:
        if self._toucher is not None:
            self._toucher.close()  # it holds the memory until it stops
            self._toucher = None
        whole, self._whole = self._whole, None
        if self._data is None:
            return
        super()._free()
        if whole is not None and whole.base is not None:
            # kept only when nothing else views it: with the buffer's own view gone, its
            # memory's owner is referenced by ``whole`` alone (and the call's argument)
            if sys.getrefcount(whole.base) == 2:
                HOST_BUFFER_CACHE.put(whole)


@dataclass
class Device(ABC):
    """A device (llama.cpp ``ggml_backend_dev``).

    Attributes:
        name: the device name (``CPU``, ``CUDA0``, ``EMU0``).
        description: a human-readable description.
        type: ``CPU``, ``GPU``, ``IGPU`` or ``ACCEL`` (llama.cpp's device types).
        backend: ``CPU``, ``CUDA`` or ``EMU``.
        device_id: a stable id (PCI bus id or UUID) used to de-duplicate devices seen
            twice; None when unknown.
        remote: placed first in the device list (llama.cpp's RPC devices).
        caps: the device's capabilities.
        default_buffer_type: where tensors assigned to the device go.
        host_buffer_type: its pinned host buffer type, if any.
        split_buffer_type: its row-split buffer type, if any.
        extra_buffer_types: further buffer types (none of hoist's devices has any).
        unsupported: op names and ggml type names the device cannot run (weights using
            them fall back along the buffer type list).
    """

    name: str
    description: str
    type: str
    backend: str
    device_id: str | None
    remote: bool
    caps: DeviceCaps
    default_buffer_type: BufferType
    host_buffer_type: BufferType | None = None
    split_buffer_type: BufferType | None = None
    extra_buffer_types: tuple[BufferType, ...] = ()
    unsupported: frozenset[str] = field(default_factory=frozenset)
    held: MemoryMeter = field(default_factory=MemoryMeter, repr=False, compare=False)
    """Device memory (not host memory) held by this process's buffers on the device."""

    @abstractmethod
    def memory(self) -> DeviceMemory:
        """Free and total memory now, in bytes."""

    @property
    def max_alloc_nbytes(self) -> int | None:
        """Largest single allocation in bytes (the default buffer type's max size)."""
        return self.default_buffer_type.max_size

    def supports(self, op: str, ggml_type: str) -> bool:
        """Whether the device can run ``op`` on a weight of ``ggml_type`` (llama.cpp's
        ``ggml_backend_dev_supports_op`` for the weight's op)."""
        return op not in self.unsupported and ggml_type not in self.unsupported

    def buffer_types(self) -> list[BufferType]:
        """Every buffer type of the device."""
        types = [self.default_buffer_type]
        for extra in (self.host_buffer_type, self.split_buffer_type, *self.extra_buffer_types):
            if extra is not None:
                types.append(extra)
        return types

    def alloc(self, buffer_type: BufferType, nbytes: int) -> DeviceBuffer:
        """Allocate a buffer of ``buffer_type`` (one of this device's types), counted in
        :attr:`held` (device memory) or :data:`HOST_MEMORY` (host buffer types) until it
        is freed.

        Raises:
            OutOfMemoryError: the device cannot allocate ``nbytes``.
        """
        if buffer_type.is_host:
            buf = self._alloc(buffer_type, nbytes)
            size = buf.nbytes
            HOST_MEMORY.add(size)
            buf.on_release(lambda: HOST_MEMORY.add(-size))
            return buf
        # device memory: allocated (or freed) and counted as one step, so that
        # :meth:`capacity` never sees the memory gone from both or counted in both
        with self.held.lock:
            buf = self._alloc(buffer_type, nbytes)
            size = buf.nbytes
            self.held.add(size)
            buf._guard = self.held.lock
            buf.on_release(lambda: self.held.add(-size))
        return buf

    def capacity(self) -> tuple[int, DeviceMemory]:
        """The device memory this process can use now, in bytes (free memory plus what
        its buffers hold on the device), and the memory it was computed from; read
        consistently with allocations and frees."""
        with self.held.lock:
            mem = self.memory()
            return mem.free + self.held.nbytes, mem

    @abstractmethod
    def _alloc(self, buffer_type: BufferType, nbytes: int) -> DeviceBuffer:
        """Allocate a buffer (the device's own work; :meth:`alloc` counts it)."""

    def open_stream(self) -> Stream | None:
        """A stream for asynchronous uploads, or None for a device without async copies
        and events (which then takes synchronous writes)."""
        return None

    @property
    def can_stage(self) -> bool:
        """Whether uploads can be staged asynchronously: async copies, events and a host
        buffer type (llama.cpp's conditions for its upload backend)."""
        c = self.caps
        return c.async_ and c.events and c.host_buffer and self.host_buffer_type is not None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready description with current memory."""
        mem = self.memory()
        return {
            "name": self.name,
            "description": self.description,
            "type": self.type,
            "backend": self.backend,
            "id": self.device_id,
            "free_bytes": mem.free,
            "total_bytes": mem.total,
            "max_alloc_bytes": self.max_alloc_nbytes,
            "caps": self.caps.to_dict(),
            "buffer_types": [b.name for b in self.buffer_types()],
        }
