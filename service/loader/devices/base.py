"""What every device reports."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """A device's memory, in bytes.

    Attributes:
        free: bytes available for new buffers now.
        total: bytes the device has in all.
    """

    free: int
    total: int


class Device(ABC):
    """A device (llama.cpp ``ggml_backend_dev``).

    Attributes:
        name: the device name (``CPU``, ``CUDA0``, ``EMU0``).
        description: a human-readable description.
        type: ``CPU``, ``GPU`` or ``ACCEL`` (llama.cpp's device types).
    """

    name: str
    description: str
    type: str

    @abstractmethod
    def memory(self) -> DeviceMemory:
        """Free and total memory now."""
