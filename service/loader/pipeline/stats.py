"""What a load did: bytes per branch, bytes from the page cache and from disk, and how
long each stage of the pipeline was busy, so that a load names the stage that bounded it.

Stages: ``touch`` (mapping, allocating, first touch and locking of the destination
buffers), ``read`` (reads and page faults of file data), ``upload`` (copies to devices),
``validate`` (check-tensors), ``hash`` (hash-tensors). A stage's busy time is the wall-clock time during which at
least one of its workers was at work, so stages that run in parallel each have their
own, and the longest is the bound.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

from service.io.staging import PoolStats

STAGES = ("touch", "read", "upload", "validate", "hash")


class StageClock:
    """Busy time and bytes of one stage, from any number of threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = 0
        self._since = 0.0
        self.seconds = 0.0
        self.nbytes = 0

    def start(self) -> None:
        """A worker of the stage starts."""
        with self._lock:
            if self._active == 0:
                self._since = time.perf_counter()
            self._active += 1

    def stop(self, nbytes: int = 0) -> None:
        """A worker of the stage stops, having moved ``nbytes``."""
        with self._lock:
            self._active -= 1
            self.nbytes += nbytes
            if self._active == 0:
                self.seconds += time.perf_counter() - self._since

    def add(self, seconds: float, nbytes: int) -> None:
        """Busy time measured elsewhere (one worker, not overlapping itself)."""
        with self._lock:
            self.seconds += seconds
            self.nbytes += nbytes

    @contextmanager
    def busy(self, nbytes: int = 0) -> Iterator[None]:
        """The stage is at work for the duration of the block, moving ``nbytes``."""
        self.start()
        try:
            yield
        finally:
            self.stop(nbytes)


@dataclass
class WorkerStats:
    """What a load did.

    Attributes:
        branches: bytes per branch (mapped, lazy, copy, read, staged, sync).
        pools: staging pool figures per device.
        direct_io: files read with direct I/O.
        notices: things the user should know (direct I/O fallbacks).
        bytes_from_cache: tensor bytes that were in the page cache when read or faulted in
            (read buffered, or mapped).
        bytes_from_disk: tensor bytes read from the disk (``O_DIRECT``, or not resident).
        bytes_unprobed: tensor bytes whose residency could not be told (``mincore`` is
            not answered truthfully for a file the process neither owns nor may write).
        reads_in_flight: the most reads the load kept in flight.
        clocks: busy time per stage.
        seconds: wall-clock time of the load's stages, from allocation to the last upload.
    """

    branches: dict[str, int] = field(default_factory=dict)
    pools: dict[str, PoolStats] = field(default_factory=dict)
    direct_io: list[str] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    bytes_from_cache: int = 0
    bytes_from_disk: int = 0
    bytes_unprobed: int = 0
    reads_in_flight: int = 1
    clocks: dict[str, StageClock] = field(default_factory=lambda: {s: StageClock() for s in STAGES})
    seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count_source(self, cache: int, disk: int, unprobed: int = 0) -> None:
        """``cache`` bytes came from the page cache, ``disk`` from the disk."""
        with self._lock:
            self.bytes_from_cache += cache
            self.bytes_from_disk += disk
            self.bytes_unprobed += unprobed

    def stage_figures(self) -> dict[str, dict[str, float]]:
        """Per stage that did anything: busy seconds, bytes, bytes per second."""
        out: dict[str, dict[str, float]] = {}
        for name, clock in self.clocks.items():
            if clock.seconds <= 0 and clock.nbytes == 0:
                continue
            rate = clock.nbytes / clock.seconds if clock.seconds > 0 else 0.0
            out[name] = {"seconds": round(clock.seconds, 6), "bytes": clock.nbytes, "bytes_per_second": round(rate)}
        return out

    def bound(self) -> dict[str, Any] | None:
        """The stage that was busy longest (the one that bounded the load), with its
        busy seconds and throughput; None when no stage did anything."""
        figures = self.stage_figures()
        if not figures:
            return None
        name = max(figures, key=lambda s: figures[s]["seconds"])
        return {"stage": name, **figures[name]}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "bytes_by_branch": dict(self.branches),
            "staging": {name: asdict(s) for name, s in self.pools.items()},
            "direct_io_files": list(self.direct_io),
            "notices": list(self.notices),
            "bytes_from_cache": self.bytes_from_cache,
            "bytes_from_disk": self.bytes_from_disk,
            "bytes_unprobed": self.bytes_unprobed,
            "reads_in_flight": self.reads_in_flight,
            "seconds": round(self.seconds, 6),
            "stages": self.stage_figures(),
            "bound": self.bound(),
        }
