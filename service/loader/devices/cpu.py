"""The host: ``CPU`` device, whose memory is the machine's, or the container's."""

from __future__ import annotations

import os
import platform
from pathlib import Path

from service.errors import OutOfMemoryError
from service.loader.devices.base import BufferType, Device, DeviceBuffer, DeviceCaps, DeviceMemory, HostBuffer

_CGROUP = Path("/sys/fs/cgroup")


def _meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes (empty where it cannot be read)."""
    out: dict[str, int] = {}
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    return out


def _cgroup_limit() -> tuple[int, int] | None:
    """The container's memory limit and usage in bytes (cgroup v2, else v1), or None
    without a limit."""
    for limit_file, usage_file in (
        (_CGROUP / "memory.max", _CGROUP / "memory.current"),
        (_CGROUP / "memory" / "memory.limit_in_bytes", _CGROUP / "memory" / "memory.usage_in_bytes"),
    ):
        try:
            limit = limit_file.read_text().strip()
            usage = int(usage_file.read_text().strip())
        except (OSError, ValueError):
            continue
        # "max" (v2) or a huge number near 2**63 (v1) mean no limit
        if limit.isdigit() and int(limit) < 1 << 60:
            return int(limit), usage
    return None


def host_memory() -> DeviceMemory:
    """Free and total host memory in bytes, bounded by the container's cgroup limit."""
    info = _meminfo()
    total = info.get("MemTotal") or os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    free = info.get("MemAvailable", info.get("MemFree", 0))
    cgroup = _cgroup_limit()
    if cgroup is not None:
        limit, usage = cgroup
        total = min(total, limit)
        free = min(free, max(limit - usage, 0))
    return DeviceMemory(free=free, total=total)


CPU_BUFFER_TYPE = BufferType("CPU", "CPU", is_host=True, alignment=32)
"""The host's default buffer type."""

MAPPED_BUFFER_NAME = "CPU_Mapped"
"""Name of a CPU buffer that wraps a range of a file mapping."""


class CPUDevice(Device):
    """The host CPU and its memory (buffer type ``CPU``; mapped buffers ``CPU_Mapped``)."""

    def __init__(self) -> None:
        super().__init__(
            name="CPU",
            description=platform.processor() or platform.machine() or "CPU",
            type="CPU",
            backend="CPU",
            device_id=None,
            remote=False,
            caps=DeviceCaps(async_=False, host_buffer=False, buffer_from_host_ptr=True, events=False),
            default_buffer_type=CPU_BUFFER_TYPE,
        )

    def memory(self) -> DeviceMemory:
        return host_memory()

    def _alloc(self, buffer_type: BufferType, nbytes: int) -> DeviceBuffer:
        try:
            return HostBuffer(buffer_type, nbytes)
        except (MemoryError, ValueError) as exc:
            raise OutOfMemoryError(f"cannot allocate a {buffer_type.name} buffer of {nbytes} bytes") from exc
