"""Devices that hold model buffers (llama.cpp's ``ggml_backend_dev``)."""

from service.loader.devices.base import Device, DeviceMemory
from service.loader.devices.cpu import CPUDevice

__all__ = ["CPUDevice", "Device", "DeviceMemory"]
