"""The devices' memory figures a plan is made against, read once before planning.

A plan weighs devices by their free memory (the split points) and checks its buffers
against it (``fits``). Reading those figures inside ``plan`` would make two plans of the
same flags differ as other processes allocate; the caller reads them once, as a
:class:`MemorySnapshot`, and planning reads only the snapshot.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from service.errors import PlacementError
from service.loader.devices import Device, DeviceMemory


@dataclass(frozen=True, slots=True)
class MemorySnapshot:
    """Free and total bytes of each device, by device name, as read at one moment.

    Attributes:
        devices: device name -> its memory when the snapshot was taken.
    """

    devices: Mapping[str, DeviceMemory]

    @classmethod
    def take(cls, devices: Iterable[Device]) -> MemorySnapshot:
        """Read the memory of every device in ``devices`` once (``Device.memory``)."""
        return cls(MappingProxyType({d.name: d.memory() for d in devices}))

    def of(self, name: str) -> DeviceMemory:
        """The memory of device ``name``.

        Raises:
            PlacementError: the snapshot has no figures for ``name`` (it was taken of
                other devices than those planned on).
        """
        try:
            return self.devices[name]
        except KeyError:
            raise PlacementError(
                f"no memory figures for device {name}: the memory snapshot was taken of other devices"
            ) from None
