"""``CUDA<i>``: NVIDIA GPUs through PyTorch (the ``cuda`` extra).

Device buffers are ``torch.uint8`` tensors on the GPU; the host buffer type
``CUDA_Host`` is pinned host memory. Nothing here imports torch until a CUDA device is
asked for, so hoist runs without it.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from service.errors import OutOfMemoryError
from service.loader.devices.base import (
    ArrayBuffer,
    BufferType,
    Device,
    DeviceBuffer,
    DeviceCaps,
    DeviceMemory,
    Event,
    Stream,
)

if TYPE_CHECKING:
    import numpy as np

CUDA_HOST_BUFFER_TYPE_NAME = "CUDA_Host"


def _torch() -> Any:
    import torch

    return torch


class CUDABuffer(DeviceBuffer):
    """GPU memory: one ``torch.uint8`` tensor on ``cuda:<i>``."""

    def __init__(self, buffer_type: BufferType, tensor: Any) -> None:
        self.buffer_type = buffer_type
        self.nbytes = int(tensor.numel())
        self._tensor: Any = tensor

    @property
    def tensor(self) -> Any:
        if self._tensor is None:
            raise RuntimeError(f"{self.buffer_type.name} buffer already freed")
        return self._tensor

    def write(self, offset: int, data: np.ndarray[Any, np.dtype[np.uint8]]) -> None:
        import numpy as np

        torch = _torch()
        with warnings.catch_warnings():
            # a read-only view of a file mapping is only read here
            warnings.simplefilter("ignore", UserWarning)
            src = torch.from_numpy(np.ascontiguousarray(data))
        self.tensor[offset : offset + len(data)].copy_(src)

    def view(self, offset: int, nbytes: int) -> Any:
        return self.tensor[offset : offset + nbytes]

    def read(self, offset: int, nbytes: int) -> bytes:
        return bytes(self.tensor[offset : offset + nbytes].cpu().numpy().tobytes())

    def _free(self) -> None:
        if self._tensor is not None:
            self._tensor = None
            self._released()


class PinnedBuffer(ArrayBuffer):
    """Pinned (page-locked) host memory from PyTorch: the ``CUDA_Host`` buffer type.

    Attributes:
        tensor: the pinned ``torch.uint8`` tensor (its numpy view is the buffer's data).
    """

    def __init__(self, buffer_type: BufferType, tensor: Any) -> None:
        super().__init__(buffer_type, tensor.numpy(), on_free=self._drop)
        self.tensor: Any = tensor

    def _drop(self) -> None:
        self.tensor = None


class CUDAEvent(Event):
    """A ``torch.cuda.Event`` recorded on an upload stream."""

    def __init__(self, event: Any) -> None:
        self._event = event

    def synchronize(self) -> None:
        self._event.synchronize()

    def query(self) -> bool:
        return bool(self._event.query())


class CUDAStream(Stream):
    """Non-blocking copies from pinned staging memory on a dedicated CUDA stream, each
    recorded with a CUDA event."""

    def __init__(self, index: int) -> None:
        torch = _torch()
        self._stream: Any = torch.cuda.Stream(device=index)

    def upload(self, dest: DeviceBuffer, dest_offset: int, src: DeviceBuffer, src_offset: int, nbytes: int) -> Event:
        torch = _torch()
        assert isinstance(dest, CUDABuffer) and isinstance(src, PinnedBuffer)
        with torch.cuda.stream(self._stream):
            dest.tensor[dest_offset : dest_offset + nbytes].copy_(
                src.tensor[src_offset : src_offset + nbytes], non_blocking=True
            )
            event = torch.cuda.Event()
            event.record(self._stream)
        return CUDAEvent(event)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
            self._stream = None


class CUDADevice(Device):
    """One CUDA GPU seen through PyTorch."""

    def __init__(self, index: int, description: str, device_id: str | None) -> None:
        name = f"CUDA{index}"
        super().__init__(
            name=name,
            description=description,
            type="GPU",
            backend="CUDA",
            device_id=device_id,
            remote=False,
            caps=DeviceCaps(async_=True, host_buffer=True, buffer_from_host_ptr=False, events=True),
            default_buffer_type=BufferType(name, name, is_host=False, alignment=128),
            host_buffer_type=BufferType(CUDA_HOST_BUFFER_TYPE_NAME, name, is_host=True, alignment=32),
        )
        self.index = index

    def open_stream(self) -> Stream | None:
        return CUDAStream(self.index)

    def memory(self) -> DeviceMemory:
        """Free and total memory; memory PyTorch's caching allocator keeps for reuse
        (reserved, no longer allocated) counts as free, since the next buffer gets it."""
        cuda = _torch().cuda
        free, total = cuda.mem_get_info(self.index)
        cached = cuda.memory_reserved(self.index) - cuda.memory_allocated(self.index)
        return DeviceMemory(int(free) + max(int(cached), 0), int(total))

    def _alloc(self, buffer_type: BufferType, nbytes: int) -> DeviceBuffer:
        torch = _torch()
        try:
            if buffer_type.is_host:
                return PinnedBuffer(buffer_type, torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))
            return CUDABuffer(buffer_type, torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{self.index}"))
        except (torch.cuda.OutOfMemoryError, RuntimeError) as exc:
            raise OutOfMemoryError(
                f"{self.name}: cannot allocate a {buffer_type.name} buffer of {nbytes} bytes"
            ) from exc


def cuda_devices() -> list[CUDADevice]:
    """Every CUDA GPU PyTorch sees; empty without torch or without a GPU."""
    try:
        torch = _torch()
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    devices = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        uuid = getattr(props, "uuid", None)
        bus = getattr(props, "pci_bus_id", None)
        device_id: str | None
        if bus is not None:
            device_id = f"{getattr(props, 'pci_domain_id', 0):04x}:{bus:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"
        else:
            device_id = str(uuid) if uuid is not None else None
        devices.append(CUDADevice(i, str(props.name), device_id))
    return devices
