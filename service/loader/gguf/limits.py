"""What the service needs of the header reader before it reads a header: the bounds it
sets on one and a file's identity (kept apart from :mod:`.reader`, which the service
imports with its first model)."""

from __future__ import annotations

import os
from dataclasses import dataclass


def file_identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """(device, inode, size, mtime in ns): what changes when a file is replaced or
    rewritten."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass(frozen=True, slots=True)
class HeaderLimits:
    """Bounds on one file's header, beyond ``gguf.cpp``'s own (None: no bound).

    Attributes:
        max_bytes: header bytes (everything before the data section) read at most.
        max_kv: KV pairs at most.
        max_tensors: tensor infos at most.
        max_splits: files of a split model at most (all of them are open at once while
            it loads).
    """

    max_bytes: int | None = None
    max_kv: int | None = None
    max_tensors: int | None = None
    max_splits: int | None = None
