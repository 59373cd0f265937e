"""What a process holds: open file descriptors, mappings of a file and their pages, threads."""

from __future__ import annotations

import os
import threading
from pathlib import Path


def open_fds() -> set[str]:
    """Targets of this process's open file descriptors."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add(f"{fd}:{os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            continue
    return out


def fds_on(path: Path | str) -> int:
    """Open file descriptors on ``path``."""
    target = os.path.realpath(path)
    return sum(1 for fd in open_fds() if fd.split(":", 1)[1] == target)


def mappings_of(path: Path | str) -> int:
    """Lines of /proc/self/maps that map ``path``."""
    target = os.path.realpath(path)
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if line.rstrip().endswith(target))


def load_threads() -> int:
    """Live hoist load worker threads."""
    return sum(1 for t in threading.enumerate() if t.name.startswith("hoist-"))


def smaps_kib(lo: int, hi: int, field: str = "Rss") -> int:
    """KiB of ``field`` (``Rss``, ``Locked``, ...) over this process's mappings that lie
    inside ``[lo, hi)`` (``/proc/self/smaps``)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, _, end = head.partition("-")
                inside = lo <= int(start, 16) and int(end, 16) <= hi
            elif inside and head == f"{field}:":
                total += int(line.split()[1])
    return total
