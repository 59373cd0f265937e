"""Tunables of a load, and its progress."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from service.errors import RequestError

MiB = 1 << 20

DEFAULT_CHUNK_NBYTES = 16 * MiB
"""Bytes read or faulted in between two progress reports / cancellation checks."""

DEFAULT_STAGING_BUFFERS = 4
"""Staging buffers per device for staged uploads (llama.cpp uses 4)."""

STAGING_NBYTES = 1 * MiB
"""Size of each staging buffer with buffered reads."""

DIRECT_IO_STAGING_NBYTES = 64 * MiB
"""Payload of each staging buffer with direct I/O (plus two alignments)."""

MAX_STAGING_NBYTES = 1 << 30
"""Largest staging buffer (and chunk) a load accepts: 1 GiB."""

MAX_STAGING_BUFFERS = 64
"""Most staging buffers per device."""

DEFAULT_READS_IN_FLIGHT = 2
"""Reads a load keeps in flight at once (chosen by measurement: ``bench/load.py``)."""

MAX_READS_IN_FLIGHT = 16
"""Most reads in flight a load accepts."""


@dataclass(frozen=True, slots=True)
class LoadOptions:
    """How a load moves bytes (not where: that is the plan).

    Attributes:
        chunk_nbytes: bytes moved between two progress reports and cancellation checks
            (mapped and read branches), in bytes. None (the default): 16 MiB, and a
            mapped range that a thread of its own faults in ahead of the load (a file
            wholly in the page cache) is one chunk per run of adjacent tensors: the
            load has nothing to step through there but that thread, waited for once.
        staging_buffers: staging buffers per device for staged uploads (N).
        staging_nbytes: size of each staging buffer in bytes; None for llama.cpp's
            default (1 MiB, or 64 MiB + 2 x alignment with direct I/O).
        check_tensors: validate every tensor's data (NaN/Inf in values and block scales)
            while loading; every bad tensor is listed before the load fails.
        hash_tensors: compute an xxh3_64 digest of every tensor's bytes while loading
            (on one thread beside the reads), given as the loaded model's
            ``tensor_hashes``.
        validation_workers: threads validating data in parallel with reading.
        direct_chunk_nbytes: bytes per direct read straight into a host buffer (rounded
            up to the filesystem's alignment); progress is still reported per tensor.
        reads_in_flight: reads issued at once, each on its own reader thread (1: every
            read on the loader thread); staged reads are also bounded by the staging
            buffers.
    """

    chunk_nbytes: int | None = None
    staging_buffers: int = DEFAULT_STAGING_BUFFERS
    staging_nbytes: int | None = None
    check_tensors: bool = False
    hash_tensors: bool = False
    validation_workers: int = 2
    direct_chunk_nbytes: int = DIRECT_IO_STAGING_NBYTES
    reads_in_flight: int = DEFAULT_READS_IN_FLIGHT

    def __post_init__(self) -> None:
        for name, low, high in (
            ("chunk_nbytes", 1, MAX_STAGING_NBYTES),
            ("staging_buffers", 1, MAX_STAGING_BUFFERS),
            ("validation_workers", 1, 64),
            ("direct_chunk_nbytes", 1, MAX_STAGING_NBYTES),
            ("reads_in_flight", 1, MAX_READS_IN_FLIGHT),
        ):
            value = getattr(self, name)
            if value is not None and not low <= value <= high:
                raise RequestError(f"{name} is {value}, it must be from {low} to {high}")
        if self.staging_nbytes is not None and not 1 <= self.staging_nbytes <= MAX_STAGING_NBYTES:
            raise RequestError(
                f"staging size is {self.staging_nbytes} bytes, it must be from 1 to {MAX_STAGING_NBYTES}"
            )

    @property
    def step_nbytes(self) -> int:
        """The chunk size in bytes (``chunk_nbytes``, or 16 MiB when that is None)."""
        return DEFAULT_CHUNK_NBYTES if self.chunk_nbytes is None else self.chunk_nbytes

    def staging_size(self, alignment: int) -> int:
        """Size of one staging buffer for reads aligned to ``alignment`` bytes."""
        if self.staging_nbytes is not None:
            return self.staging_nbytes + (2 * alignment if alignment > 1 else 0)
        return DIRECT_IO_STAGING_NBYTES + 2 * alignment if alignment > 1 else STAGING_NBYTES


@dataclass(frozen=True, slots=True)
class Progress:
    """Progress of a load, in bytes of tensor data.

    Attributes:
        bytes_done: bytes in place so far (monotonic).
        bytes_total: bytes the load brings in (a tensor loaded to two buffers counts twice).
        by_device: bytes in place so far per device name (the device a tensor is placed
            on; mapped CPU tensors count for ``CPU``); sums to ``bytes_done``.
    """

    bytes_done: int
    bytes_total: int
    by_device: Mapping[str, int] = field(default_factory=dict)

    @property
    def fraction(self) -> float:
        """``bytes_done / bytes_total`` (1.0 for an empty model)."""
        return self.bytes_done / self.bytes_total if self.bytes_total else 1.0


ProgressCallback = Callable[[Progress], bool | None]
"""Called on the event loop after each chunk; returning ``False`` cancels the load."""
