"""Counting the memory hoist holds, per memory (a device's, or the host's)."""

from __future__ import annotations

import threading


class MemoryMeter:
    """Bytes that hoist's buffers hold in one memory (a device's, or the host's); kept
    as buffers are allocated and freed, from any thread."""

    def __init__(self) -> None:
        self._nbytes = 0
        self.lock = threading.RLock()
        """Held while the count changes; a device holds it across an allocation or a
        free and the change of count, so that free memory and the count read under it
        agree."""

    @property
    def nbytes(self) -> int:
        """Bytes held now."""
        return self._nbytes

    def add(self, nbytes: int) -> None:
        """Count ``nbytes`` more (negative: fewer)."""
        with self.lock:
            self._nbytes += nbytes


HOST_MEMORY = MemoryMeter()
"""Host memory held by this process's buffers of host buffer types (``CPU``, pinned and
staging buffers) and by locked file mappings."""
