"""Buffer type lists and the choice of a buffer type for each weight
(llama.cpp's ``make_cpu_buft_list``, ``make_gpu_buft_list`` and ``select_weight_buft``)."""

from __future__ import annotations

from collections.abc import Sequence

from service.errors import PlacementError
from service.loader.devices import BufferType, Device
from service.loader.placement.params import SplitMode

BuftList = list[tuple[Device, BufferType]]


def cpu_buft_list(devices: Sequence[Device], chosen: Sequence[Device], *, no_host: bool) -> BuftList:
    """The CPU list: accelerator devices' buffer types, then the pinned host buffer type
    of the first chosen device that has one (unless ``no_host``), then ``CPU``."""
    out: BuftList = []
    for dev in devices:
        if dev.type == "ACCEL" and dev.default_buffer_type.name != "CPU":
            out.append((dev, dev.default_buffer_type))
    if not no_host:
        for dev in chosen:
            if dev.host_buffer_type is not None:
                out.append((dev, dev.host_buffer_type))
                break
    for dev in devices:
        if dev.type == "CPU":
            out.append((dev, dev.default_buffer_type))
    return out


def gpu_buft_list(dev: Device, split_mode: SplitMode, cpu_list: BuftList) -> BuftList:
    """A device's list: its split buffer type (split mode ``row``), its default buffer
    type, its extra buffer types, then the CPU list as the fallback.

    Raises:
        PlacementError: split mode ``row`` on a device without a split buffer type.
    """
    out: BuftList = []
    if split_mode is SplitMode.ROW:
        if dev.split_buffer_type is None:
            raise PlacementError(f"device {dev.name} does not support split buffers")
        out.append((dev, dev.split_buffer_type))
    out.append((dev, dev.default_buffer_type))
    out.extend((dev, b) for b in dev.extra_buffer_types)
    out.extend(cpu_list)
    return out


def select_weight_buft(buft_list: BuftList, op: str, ggml_type: str) -> tuple[Device, BufferType] | None:
    """The first buffer type in ``buft_list`` whose device supports ``op`` on a weight of
    ``ggml_type``, or None."""
    for dev, buft in buft_list:
        if dev.supports(op, ggml_type):
            return dev, buft
    return None
