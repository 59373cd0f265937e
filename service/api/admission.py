"""Admission of loads: a bound on waiting loads, and memory reserved per device at submit
for every queued load, running load and resident model, so that a load that cannot fit
is refused at once rather than failing later."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from service.errors import BudgetExceededError
from service.io.meter import HOST_MEMORY
from service.loader.devices import Device
from service.loader.placement import Plan

MiB = 1 << 20


def plan_needs(p: Plan, staging: int = 0) -> dict[str, int]:
    """Bytes ``p`` needs per memory (device name, ``CPU`` for host memory): what it
    allocates, mapped bytes it locks, and ``staging`` bytes of host staging buffers."""
    needs = {u.device: u.needed for u in p.device_use if u.needed}
    if staging:
        needs["CPU"] = needs.get("CPU", 0) + staging
    return needs


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

    Args:
        devices: the devices (one of them the CPU); memories are named by device, host
            memory ``CPU``.
    """

    def __init__(self, devices: Sequence[Device]) -> None:
        self.devices = {d.name: d for d in devices}
        self.owners: dict[str, dict[str, int]] = {}

    def reserved(self, memory: str, *, excluding: str | None = None) -> tuple[int, int]:
        """Bytes reserved in ``memory`` and by how many owners (``excluding`` one)."""
        total = holders = 0
        for owner, needs in self.owners.items():
            if owner != excluding and needs.get(memory):
                total += needs[memory]
                holders += 1
        return total, holders

    def _capacity(self, memory: str) -> tuple[int, int] | None:
        """(capacity, free now) of ``memory``; None for a device that reports no memory
        (it allocates without a limit)."""
        device = self.devices.get(memory)
        if device is None:
            return None
        mem = device.memory()
        if mem.total == 0:
            return None
        held = HOST_MEMORY.nbytes if device.type == "CPU" else device.held.nbytes
        return mem.free + held, mem.free

    def shortfalls(self, owner: str, needs: dict[str, int]) -> list[Shortfall]:
        """The memories where ``needs`` does not fit beside the other owners'."""
        out = []
        for memory, needed in needs.items():
            cap = self._capacity(memory)
            if cap is None or not needed:
                continue
            capacity, free = cap
            reserved, holders = self.reserved(memory, excluding=owner)
            available = max(capacity - reserved, 0)
            if needed > available:
                out.append(Shortfall(memory, needed, available, free, reserved, holders))
        return out

    def reserve(self, owner: str, needs: dict[str, int], *, model: str | None = None) -> None:
        """Reserve ``needs`` (bytes per memory) for ``owner``, replacing what it had.

        Raises:
            BudgetExceededError: some memory cannot hold it beside the other owners'
                reservations; the message gives the figures per memory.
        """
        short = self.shortfalls(owner, needs)
        if short:
            raise BudgetExceededError(
                "the model does not fit beside the loads and models already admitted: "
                + "; ".join(s.describe() for s in short),
                path=model,
                hint="unload a model, wait for loads to finish, offload fewer layers (-ngl) or change --tensor-split",
            )
        self.owners[owner] = dict(needs)

    def replace(self, owner: str, needs: dict[str, int]) -> None:
        """Set ``owner``'s reservation to ``needs`` without checking (for a reservation
        that shrinks, as when a load ends and its staging buffers are freed)."""
        self.owners[owner] = dict(needs)

    def release(self, owner: str) -> None:
        """Drop ``owner``'s reservation (if any)."""
        self.owners.pop(owner, None)
