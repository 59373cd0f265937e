"""``EMU<i>``: emulated discrete GPUs with declared memory sizes.

An emulated device behaves like a discrete GPU for placement and loading: its memory is
not host memory (its buffers are separate allocations counted against the declared
size), it has a pinned-like host buffer type ``EMU_Host`` for staging, it copies
asynchronously with completion events, and it accepts every op unless told otherwise.
It mirrors the RPC devices llama.cpp uses to stand in for GPUs (placed first, no split
buffer type), so that multi-device placement can be planned and tested without GPUs.

Declared as ``NAME=SIZE[:option...]`` separated by commas, e.g.
``EMU0=3000MiB,EMU1=1000MiB:max_alloc=256MiB``. Options:

- ``max_alloc=SIZE``: largest single allocation.
- ``unsupported=A+B``: op names (``MUL_MAT_ID``) or ggml types (``Q4_K``) the device
  refuses, so that weights using them fall back along the buffer type list.
- ``no_mmap``: the device cannot load from mapped memory (``auto`` then reads).
- ``sync``: no async copies, events or host buffer type (the synchronous fallback).
- ``bandwidth=SIZE``: upload bytes per second, to emulate a bus (copies take that long).

A size of 0 declares a device that reports 0/0 memory (as some backends do).
"""

from __future__ import annotations

import queue
import re
import threading
import time
from collections.abc import Callable
from typing import Any

from service.errors import OutOfMemoryError, RequestError
from service.io.align import aligned_empty
from service.loader.devices.base import (
    ArrayBuffer,
    BufferType,
    Device,
    DeviceBuffer,
    DeviceCaps,
    DeviceMemory,
    Event,
    HostBuffer,
    Stream,
)

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
    "K": 1 << 10,
    "M": 1 << 20,
    "G": 1 << 30,
}
_SIZE = re.compile(r"^\s*([0-9]{1,20}(?:\.[0-9]{1,20})?)\s*([A-Za-z]*)\s*$", re.ASCII)
_NAME = re.compile(r"^EMU([0-9]{1,3})$", re.ASCII)
_MAX_SIZE = 1 << 60

EMU_HOST_BUFFER_TYPE_NAME = "EMU_Host"


def parse_size(text: str) -> int:
    """``3000MiB``, ``2GiB``, ``1.5GB``, ``4096`` -> bytes (at most 2**60). Raises
    RequestError."""
    m = _SIZE.match(text)
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in _UNITS:
        raise RequestError(f"invalid size '{text[:50]}' (expected e.g. 3000MiB, 2GiB or a number of bytes)")
    value = float(m.group(1)) * _UNITS[unit]
    if value > _MAX_SIZE:
        raise RequestError(f"size '{text[:50]}' is too large (at most {_MAX_SIZE} bytes)")
    if 0 < value < 1:
        raise RequestError(f"size '{text[:50]}' is less than one byte")
    return int(value)


class _ThreadEvent(Event):
    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None

    def set(self, error: BaseException | None = None) -> None:
        self.error = error
        self.done_at = time.perf_counter()
        self._done.set()

    def synchronize(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise self.error

    def query(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float) -> bool:
        """Block until the copy is done or ``timeout`` seconds passed; True when done."""
        return self._done.wait(timeout)


class EMUStream(Stream):
    """Uploads to an emulated device on a worker thread, in order, each completing an
    event (as a CUDA stream would) stamped with its completion time; ``bandwidth`` bytes
    per second, if given, paces them."""

    stamps_events = True

    def __init__(self, device: EMUDevice) -> None:
        self.device = device
        self._queue: queue.SimpleQueue[tuple[Callable[[], None], _ThreadEvent] | None] = queue.SimpleQueue()
        self._aborted = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"hoist-{device.name}-stream", daemon=True)
        self._thread.start()
        self._closed = False

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            work, event = item
            if self._aborted.is_set():
                event.set(RuntimeError(f"{self.device.name} upload aborted"))
                continue
            try:
                work()
            except BaseException as exc:  # delivered through the event
                event.set(exc)
            else:
                event.set()

    def abort(self) -> None:
        self._aborted.set()

    def upload(self, dest: DeviceBuffer, dest_offset: int, src: DeviceBuffer, src_offset: int, nbytes: int) -> Event:
        if self._closed:
            raise RuntimeError(f"{self.device.name} stream is closed")
        event = _ThreadEvent()
        bandwidth = self.device.bandwidth

        def work() -> None:
            started = time.perf_counter()
            dest.write(dest_offset, src.view(src_offset, nbytes))
            if bandwidth:
                remaining = nbytes / bandwidth - (time.perf_counter() - started)
                if remaining > 0:
                    self._aborted.wait(remaining)  # pacing that an abort cuts short

        self._queue.put((work, event))
        return event

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join()


class EMUDevice(Device):
    """An emulated discrete GPU.

    Args:
        index: the ``i`` of ``EMU<i>``.
        total: declared memory in bytes (0: reports 0/0 and allocates without a limit).
        max_alloc: largest single allocation in bytes, or None.
        unsupported: op and ggml type names the device refuses.
        mmap_support: whether it can load from mapped memory.
        sync: no async copies, events or host buffer type.
        bandwidth: upload bytes per second (None: as fast as memory copies go).
    """

    def __init__(
        self,
        index: int,
        total: int,
        *,
        max_alloc: int | None = None,
        unsupported: frozenset[str] = frozenset(),
        mmap_support: bool = True,
        sync: bool = False,
        bandwidth: int | None = None,
    ) -> None:
        name = f"EMU{index}"
        super().__init__(
            name=name,
            description=f"emulated GPU with {total / (1 << 20):.0f} MiB",
            type="GPU",
            backend="EMU",
            device_id=f"emu:{index}",
            remote=True,
            caps=DeviceCaps(
                async_=not sync,
                host_buffer=not sync,
                buffer_from_host_ptr=False,
                events=not sync,
                mmap_support=mmap_support,
            ),
            default_buffer_type=BufferType(name, name, is_host=False, alignment=32, max_size=max_alloc),
            host_buffer_type=None if sync else BufferType(EMU_HOST_BUFFER_TYPE_NAME, name, is_host=True),
            unsupported=unsupported,
        )
        self.total = total
        self.allocated = 0
        self.bandwidth = bandwidth
        self._lock = threading.Lock()

    def open_stream(self) -> Stream | None:
        return EMUStream(self) if self.caps.async_ else None

    def memory(self) -> DeviceMemory:
        if self.total == 0:
            return DeviceMemory(0, 0)
        with self._lock:
            return DeviceMemory(free=max(self.total - self.allocated, 0), total=self.total)

    def _alloc(self, buffer_type: BufferType, nbytes: int) -> DeviceBuffer:
        if buffer_type.is_host:
            try:
                return HostBuffer(buffer_type, nbytes)
            except (MemoryError, ValueError) as exc:
                raise OutOfMemoryError(f"cannot allocate a {buffer_type.name} buffer of {nbytes} bytes") from exc
        limit = self.default_buffer_type.max_size
        if limit is not None and nbytes > limit:
            raise OutOfMemoryError(
                f"{self.name}: a buffer of {nbytes} bytes exceeds the largest allocation ({limit} bytes)"
            )
        with self._lock:
            if self.total and self.allocated + nbytes > self.total:
                raise OutOfMemoryError(
                    f"{self.name}: out of memory allocating {nbytes} bytes "
                    f"({self.total - self.allocated} of {self.total} bytes free)"
                )
            self.allocated += nbytes
        try:
            # device memory, emulated: a separate allocation counted against the device
            return ArrayBuffer(buffer_type, aligned_empty(nbytes), on_free=lambda: self._release(nbytes))
        except (MemoryError, ValueError) as exc:
            self._release(nbytes)
            raise OutOfMemoryError(f"{self.name}: cannot allocate {nbytes} bytes of host RAM to emulate it") from exc

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self.allocated -= nbytes


def parse_emulated_devices(spec: str | None) -> list[EMUDevice]:
    """Devices from ``"EMU0=3000MiB,EMU1=1000MiB:max_alloc=256MiB"``; empty for None/"".

    Raises:
        RequestError: a malformed entry, name or option.
    """
    devices: list[EMUDevice] = []
    if not spec or not spec.strip():
        return devices
    seen: set[int] = set()
    for entry in spec.split(","):
        head, *options = entry.strip().split(":")
        name, eq, size = head.partition("=")
        m = _NAME.match(name.strip())
        if not eq or m is None:
            raise RequestError(f"invalid emulated device '{entry.strip()}' (expected e.g. EMU0=3000MiB)")
        index = int(m.group(1))
        if index in seen:
            raise RequestError(f"emulated device EMU{index} is declared twice")
        seen.add(index)
        kwargs: dict[str, Any] = {}
        for option in options:
            key, _, value = option.strip().partition("=")
            if key in ("max_alloc", "unsupported", "no_mmap", "sync", "bandwidth") and (
                {"no_mmap": "mmap_support"}.get(key, key) in kwargs
            ):
                raise RequestError(f"option '{key}' is given twice for emulated device EMU{index}")
            if key == "max_alloc" and value:
                kwargs["max_alloc"] = parse_size(value)
            elif key == "unsupported" and value:
                kwargs["unsupported"] = frozenset(v.strip() for v in value.split("+") if v.strip())
            elif key == "no_mmap" and not value:
                kwargs["mmap_support"] = False
            elif key == "sync" and not value:
                kwargs["sync"] = True
            elif key == "bandwidth" and value:
                kwargs["bandwidth"] = parse_size(value)
                if kwargs["bandwidth"] <= 0:
                    raise RequestError(f"bandwidth of emulated device EMU{index} must be positive")
            else:
                raise RequestError(
                    f"unknown option '{option}' for emulated device EMU{index} "
                    "(known: max_alloc=SIZE, unsupported=A+B, no_mmap, sync, bandwidth=SIZE)"
                )
        devices.append(EMUDevice(index, parse_size(size), **kwargs))
    return devices
