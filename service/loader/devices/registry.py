"""The devices of this process: the CPU, CUDA GPUs through PyTorch, emulated GPUs."""

from __future__ import annotations

from service.loader.devices.base import Device
from service.loader.devices.cpu import CPUDevice
from service.loader.devices.cuda import cuda_devices
from service.loader.devices.emulated import parse_emulated_devices


def discover_devices(emulated: str | None = None, *, cuda: bool = True) -> list[Device]:
    """The CPU, then every CUDA GPU (when ``cuda`` and PyTorch sees one), then the
    emulated devices declared in ``emulated`` (``"EMU0=3000MiB,EMU1=1000MiB"``).

    Raises:
        RequestError: a malformed emulated device declaration.
    """
    devices: list[Device] = [CPUDevice()]
    if cuda:
        devices.extend(cuda_devices())
    devices.extend(parse_emulated_devices(emulated))
    return devices
