"""Counting the memory hoist holds, per memory (a device's, or the host's)."""

from __future__ import annotations

import threading


class MemoryMeter:
    """Bytes that hoist's buffers hold in one memory (a device's, or the host's); kept
    as buffers are allocated and freed, from any thread."""

    def __init__(self) -> None:
        self._nbytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Bytes held now."""
        return self._nbytes

    def add(self, nbytes: int) -> None:
        """Count ``nbytes`` more (negative: fewer)."""
        with self._lock:
            self._nbytes += nbytes


HOST_MEMORY = MemoryMeter()
"""Host memory held by this process's buffers of host buffer types (``CPU``, pinned and
staging buffers) and by locked file mappings."""
