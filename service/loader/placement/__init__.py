"""Placement: which device and buffer type every tensor gets, as llama.cpp decides it.

The names below are imported from their modules with their first use (the service
starts without the planner and the weight index): the load-mode enums are imported
here, the rest on access.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

from service.lazy import lazy_exports
from service.loader.modes import FlagValue, LazyMode, LoadMode, SplitMode

if TYPE_CHECKING:
    from service.loader.placement.buffers import BufferPlan, TensorPlacement
    from service.loader.placement.memory import MemorySnapshot
    from service.loader.placement.params import (
        PlacementParams,
        TensorOverride,
        make_params,
        parse_n_gpu_layers,
        parse_overrides,
        parse_tensor_split,
    )
    from service.loader.placement.plan import DeviceUse, MovedTensors, Plan, plan

__all__ = [
    "BufferPlan",
    "DeviceUse",
    "FlagValue",
    "LazyMode",
    "LoadMode",
    "MemorySnapshot",
    "MovedTensors",
    "Plan",
    "PlacementParams",
    "SplitMode",
    "TensorOverride",
    "TensorPlacement",
    "make_params",
    "parse_n_gpu_layers",
    "parse_overrides",
    "parse_tensor_split",
    "plan",
]

_HOME = {
    "BufferPlan": "buffers",
    "TensorPlacement": "buffers",
    "MemorySnapshot": "memory",
    "PlacementParams": "params",
    "TensorOverride": "params",
    "make_params": "params",
    "parse_n_gpu_layers": "params",
    "parse_overrides": "params",
    "parse_tensor_split": "params",
    "DeviceUse": "plan",
    "MovedTensors": "plan",
    "Plan": "plan",
    "plan": "plan",
}
"""The module of this package that defines each lazily exported name."""


__getattr__ = lazy_exports(__name__, _HOME)


class _Package(types.ModuleType):
    """This package's module type: the name ``plan`` stays the function :func:`plan`
    when the submodule of the same name is imported (the import system sets a package's
    attribute to each submodule it loads; the submodule stays in ``sys.modules``)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "plan" and isinstance(value, types.ModuleType):
            return  # ``plan`` is resolved by __getattr__, to the function
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
