"""The host: ``CPU`` device, whose memory is the machine's, or the container's."""

from __future__ import annotations

import os
import platform
from functools import cache
from pathlib import Path

from service.errors import OutOfMemoryError
from service.loader.devices.base import BufferType, Device, DeviceBuffer, DeviceCaps, DeviceMemory, HostBuffer

_CGROUP = Path("/sys/fs/cgroup")
_PROC_CGROUP = Path("/proc/self/cgroup")


def _read_small(path: str | Path) -> str | None:
    """The text of a small kernel file (``/proc``, ``/sys``: one read of up to 64 KiB),
    or None where it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, 1 << 16).decode("utf-8", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def _meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes (empty where it cannot be read)."""
    out: dict[str, int] = {}
    text = _read_small("/proc/meminfo")
    if text is None:
        return out
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    return out


def _own_cgroups() -> list[tuple[Path, str, str]]:
    """The directories of this process's memory cgroup and its ancestors, innermost first,
    each with its limit and usage file names (cgroup v2, else v1)."""
    lines = (_read_small(_PROC_CGROUP) or "").splitlines()
    found: list[tuple[Path, str, str]] = []
    for line in lines:
        _, controllers, path = line.split(":", 2) if line.count(":") >= 2 else ("", "", "")
        if controllers == "":
            base, files = _CGROUP, ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            base, files = _CGROUP / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        parts = [p for p in path.split("/") if p and p not in (".", "..")]
        found += [(base.joinpath(*parts[:k]), *files) for k in range(len(parts), -1, -1)]
    if not found:
        found = [(_CGROUP, "memory.max", "memory.current"), (_CGROUP / "memory", *_V1_FILES)]
    return found


_V1_FILES = ("memory.limit_in_bytes", "memory.usage_in_bytes")


def _cgroup_limit() -> tuple[int, int] | None:
    """The smallest memory limit of this process's cgroup and its ancestors, and the fewest
    bytes left under any of them, or None without a limit. A limit set on the service's own cgroup (a
    systemd ``MemoryMax=``) counts as well as the container's."""
    best: tuple[int, int] | None = None
    for directory, limit_name, usage_name in _own_cgroups():
        limit = (_read_small(f"{directory}/{limit_name}") or "").strip()
        try:
            usage = int((_read_small(f"{directory}/{usage_name}") or "").strip())
        except ValueError:
            continue
        # "max" (v2) or a huge number near 2**63 (v1) mean no limit
        if not limit.isdigit() or int(limit) >= 1 << 60:
            continue
        left = max(int(limit) - usage, 0)
        best = (int(limit), left) if best is None else (min(best[0], int(limit)), min(best[1], left))
    return best


@cache
def cpu_description() -> str:
    """The processor's name: the first ``model name`` of ``/proc/cpuinfo``, as ggml's CPU
    device describes itself; the machine type (``x86_64``) or ``CPU`` where there is
    none. Read once per process."""
    for line in (_read_small("/proc/cpuinfo") or "").splitlines():  # the first processor's block
        key, sep, value = line.partition(":")
        if sep and key.strip() == "model name" and value.strip():
            return value.strip()[:256]
    return platform.machine() or "CPU"


def host_memory() -> DeviceMemory:
    """Free and total host memory in bytes, bounded by the container's cgroup limit."""
    info = _meminfo()
    total = info.get("MemTotal") or os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    free = info.get("MemAvailable", info.get("MemFree", 0))
    cgroup = _cgroup_limit()
    if cgroup is not None:
        limit, left = cgroup
        total = min(total, limit)
        free = min(free, left)
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
            description=cpu_description(),
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
