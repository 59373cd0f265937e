"""Devices that hold model buffers (llama.cpp's ``ggml_backend_dev``)."""

from service.io.meter import HOST_MEMORY, MemoryMeter
from service.loader.devices.base import (
    BufferType,
    Device,
    DeviceBuffer,
    DeviceCaps,
    DeviceMemory,
    Event,
    HostBuffer,
    Stream,
)
from service.loader.devices.cpu import CPU_BUFFER_TYPE, MAPPED_BUFFER_NAME, CPUDevice
from service.loader.devices.emulated import EMUDevice, parse_emulated_devices, parse_size
from service.loader.devices.registry import discover_devices

__all__ = [
    "HOST_MEMORY",
    "CPU_BUFFER_TYPE",
    "MAPPED_BUFFER_NAME",
    "BufferType",
    "CPUDevice",
    "Device",
    "DeviceBuffer",
    "DeviceCaps",
    "DeviceMemory",
    "EMUDevice",
    "Event",
    "HostBuffer",
    "MemoryMeter",
    "Stream",
    "discover_devices",
    "parse_emulated_devices",
    "parse_size",
]
