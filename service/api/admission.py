"""Admission of loads: memory reserved per device at submit for every queued load,
running load and resident model, and the process's memory mappings likewise, so that a
load that cannot fit is refused at once rather than failing later."""

from __future__ import annotations

import os
import resource
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from service.errors import BudgetExceededError
from service.io.meter import HOST_MEMORY

if TYPE_CHECKING:
    from service.loader.devices import Device
    from service.loader.placement import Plan
    from service.loader.weights import WeightIndex

MiB = 1 << 20


METADATA_PER_TENSOR = 4096
"""Host bytes counted for each tensor's metadata (its info, weight, placement, loaded
view and their Python objects; measured at 1.2 to 4 KiB, allocator slack included)."""

METADATA_PER_KV = 512
"""Host bytes counted for each KV pair (its entry, key and value objects)."""

METADATA_PER_FILE = 64 << 10
"""Host bytes counted for each file of a model (its mapping, descriptors, buffers)."""

HEADER_FACTOR = 4
"""Host bytes counted per header byte: arrays are kept as bytes, and a string value
decoded to Python text can take 4 bytes a character."""

MAPPINGS = "mappings"
"""The name under which reservations count the process's memory mappings."""

MAPPINGS_PER_FILE = 3
"""Mappings counted per mapped file (locking or unmapping parts can split one in three)."""

DESCRIPTORS = "file descriptors"
"""The name under which reservations count the process's open file descriptors."""


def metadata_nbytes(index: WeightIndex) -> int:
    """Host bytes a model's metadata takes while it is queued, loading or resident: its
    headers, KV pairs, tensors and files, each by a measured upper figure."""
    headers = sum(f.data_offset for f in index.files)
    kvs = sum(len(f.kv) for f in index.files)
    return (
        HEADER_FACTOR * headers
        + METADATA_PER_KV * kvs
        + METADATA_PER_TENSOR * len(index)
        + METADATA_PER_FILE * len(index.files)
    )


def plan_needs(p: Plan, staging: int = 0, staging_buffers: int = 0, open_files: int = 0) -> dict[str, int]:
    """What ``p`` needs per memory (device name, ``CPU`` for host memory), in bytes: what it
    allocates, mapped bytes it locks, and ``staging`` bytes of host staging buffers; under
    :data:`MAPPINGS`, the memory mappings it makes (files mapped, allocations and
    ``staging_buffers`` buffers); and under :data:`DESCRIPTORS`, the ``open_files`` file
    descriptors its load holds open."""
    needs = {u.device: u.needed for u in p.device_use if u.needed}
    if staging:
        needs["CPU"] = needs.get("CPU", 0) + staging
    mapped_files = {b.file_index for b in p.buffers if b.mapped} | {t.file_index for t in p.tensors if t.lazy}
    if p.use_mmap:
        mapped_files |= {t.file_index for t in p.tensors}
    allocations = sum(len(b.chunks) for b in p.buffers if not b.mapped)
    needs[MAPPINGS] = MAPPINGS_PER_FILE * len(mapped_files) + allocations + staging_buffers
    if open_files:
        needs[DESCRIPTORS] = open_files
    return needs


def max_map_count() -> int:
    """The kernel's limit on one process's memory mappings (``vm.max_map_count``)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530


def descriptor_limit() -> int:
    """The process's soft limit on open file descriptors (``RLIMIT_NOFILE``)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def descriptors_now() -> int:
    """The file descriptors this process has open now."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def mappings_now() -> int:
    """The memory mappings this process has now (lines of ``/proc/self/maps``)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


@dataclass(frozen=True, slots=True)
class Shortfall:
    """One memory that cannot hold a reservation."""

    device: str
    needed: int
    available: int
    free: int
    reserved: int
    holders: int

    def describe(self) -> str:
        if self.device == DESCRIPTORS:
            return (
                f"the load needs {self.needed} file descriptors, {self.available} are available "
                f"(RLIMIT_NOFILE, less the connections' share and what the other loads hold)"
            )
        if self.device == MAPPINGS:
            return (
                f"the process needs {self.needed} more memory mappings, {self.available} are available "
                f"(vm.max_map_count, less what the process and the other loads and models hold)"
            )
        return (
            f"{self.device} needs {self.needed / MiB:.2f} MiB, {self.available / MiB:.2f} MiB available "
            f"({self.free / MiB:.2f} MiB free now; {self.reserved / MiB:.2f} MiB reserved by "
            f"{self.holders} load{'s' if self.holders != 1 else ''} and model{'s' if self.holders != 1 else ''})"
        )


class Reservations:
    """Memory reserved per device by owners (load jobs, then the models they load).

    A memory's capacity for hoist is what is free now plus what hoist's own buffers hold
    there now (counted as they are allocated and freed); a reservation fits when every
    owner's reservation, this one included, stays within it. Loads that have not
    allocated yet and loads that have are so counted once each.

    Memory mappings are counted the same way against ``vm.max_map_count``, less the
    mappings the process had when the reservations began and a margin for what it maps
    on its own (threads, allocations): a process at that limit cannot map, allocate or
    start a thread.

    Open file descriptors (a load holds each file of its model open) are counted against
    ``RLIMIT_NOFILE``, less those open when the reservations began, ``descriptors_kept``
    (the connections') and a margin.

    Args:
        devices: the devices (one of them the CPU); memories are named by device, host
            memory ``CPU``.
        descriptors_kept: file descriptors kept for other uses (connections).
    """

    MAPPING_MARGIN = 4096
    """Mappings kept for the process's own use (at least; or a tenth of the limit)."""

    DESCRIPTOR_MARGIN = 64
    """File descriptors kept for the process's own use (dry runs, logs, pipes)."""

    def __init__(self, devices: Sequence[Device], *, descriptors_kept: int = 0) -> None:
        self.devices = {d.name: d for d in devices}
        self.owners: dict[str, dict[str, int]] = {}
        self.metadata: dict[str, int] = {}
        limit = max_map_count()
        self.mapping_capacity = max(limit - mappings_now() - max(self.MAPPING_MARGIN, limit // 10), 0)
        self.descriptor_capacity = max(
            descriptor_limit() - descriptors_now() - descriptors_kept - self.DESCRIPTOR_MARGIN, 0
        )

    def reserved(self, memory: str, *, excluding: str | Collection[str] | None = None) -> tuple[int, int]:
        """Bytes reserved in ``memory`` and by how many owners (``excluding`` one, or
        several)."""
        skip = {excluding} if isinstance(excluding, str) else set(excluding or ())
        total = holders = 0
        for owner, needs in self.owners.items():
            if owner not in skip and needs.get(memory):
                total += needs[memory]
                holders += 1
        return total, holders

    def _capacity(self, memory: str) -> tuple[int, int] | None:
        """(capacity, free now) of ``memory``; None for a device that reports no memory
        (it allocates without a limit)."""
        if memory == MAPPINGS:
            return self.mapping_capacity, self.mapping_capacity
        if memory == DESCRIPTORS:
            return self.descriptor_capacity, self.descriptor_capacity
        device = self.devices.get(memory)
        if device is None:
            return None
        if device.type == "CPU":
            mem = device.memory()
            capacity = mem.free + HOST_MEMORY.nbytes
        else:
            capacity, mem = device.capacity()
        return None if mem.total == 0 else (capacity, mem.free)

    def capacities(self) -> dict[str, tuple[int, int] | None]:
        """(capacity, free now) of every device's memory, as :meth:`shortfalls` counts
        them (None where a device reports none). Blocking: a device's memory query can
        take a while (CUDA), so callers on the event loop run it on a thread."""
        return {name: self._capacity(name) for name in self.devices}

    def shortfalls(
        self,
        owner: str,
        needs: dict[str, int],
        *,
        capacities: Mapping[str, tuple[int, int] | None] | None = None,
        excluding: Collection[str] = (),
    ) -> list[Shortfall]:
        """The memories where ``needs`` does not fit beside the other owners' (but those
        in ``excluding``), with device capacities from ``capacities`` where it has them
        (:meth:`capacities`, taken a moment ago) and queried now otherwise."""
        out = []
        for memory, needed in needs.items():
            cap = capacities[memory] if capacities is not None and memory in capacities else self._capacity(memory)
            if cap is None or not needed:
                continue
            capacity, free = cap
            reserved, holders = self.reserved(memory, excluding={owner, *excluding})
            available = max(capacity - reserved, 0)
            if needed > available:
                out.append(Shortfall(memory, needed, available, free, reserved, holders))
        return out

    def reserve(
        self,
        owner: str,
        needs: dict[str, int],
        *,
        model: str | None = None,
        metadata: int = 0,
        capacities: Mapping[str, tuple[int, int] | None] | None = None,
    ) -> None:
        """Reserve ``needs`` (per memory) for ``owner``, replacing what it had, and
        ``metadata`` more host bytes that the owner holds already (its parsed model),
        which count as held by hoist until :meth:`release`. ``capacities``: as
        :meth:`shortfalls` takes them (taken after the metadata was parsed).

        Raises:
            BudgetExceededError: some memory cannot hold it beside the other owners'
                reservations; the message gives the figures per memory.
        """
        needs = dict(needs)
        # the metadata is in memory already: held, and needed, like any buffer
        added = metadata - self.metadata.get(owner, 0)
        HOST_MEMORY.add(added)
        if metadata:
            needs["CPU"] = needs.get("CPU", 0) + metadata
        if capacities is not None and capacities.get("CPU") is not None:
            # host capacity counts what hoist holds: the metadata now held, too
            capacity, free = capacities["CPU"]  # type: ignore[misc]
            capacities = {**capacities, "CPU": (capacity + added, free)}
        short = self.shortfalls(owner, needs, capacities=capacities)
        if short:
            HOST_MEMORY.add(-added)
            raise BudgetExceededError(
                "the model does not fit beside the loads and models already admitted: "
                + "; ".join(s.describe() for s in short),
                path=model,
                hint="unload a model, wait for loads to finish, offload fewer layers (-ngl) or change --tensor-split",
            )
        self.owners[owner] = needs
        if metadata:
            self.metadata[owner] = metadata

    def replace(self, owner: str, needs: dict[str, int]) -> None:
        """Set ``owner``'s reservation to ``needs`` (and its metadata) without checking,
        for a reservation that shrinks, as when a load ends and its staging buffers are
        freed."""
        self.owners[owner] = dict(needs)
        if self.metadata.get(owner):
            self.owners[owner]["CPU"] = self.owners[owner].get("CPU", 0) + self.metadata[owner]

    def release(self, owner: str) -> None:
        """Drop ``owner``'s reservation (if any) and its metadata."""
        self.owners.pop(owner, None)
        HOST_MEMORY.add(-self.metadata.pop(owner, 0))
