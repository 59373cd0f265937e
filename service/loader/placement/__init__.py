"""Placement: which device and buffer type every tensor gets, as llama.cpp decides it."""

from service.loader.modes import FlagValue, LazyMode, LoadMode, SplitMode
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
