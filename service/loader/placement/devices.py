"""Which devices a model uses, in which order, and in what proportions
(llama.cpp's ``llama_prepare_model_devices`` and the split points of ``load_tensors``)."""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence

import numpy as np

from service.errors import PlacementError
from service.loader.devices import Device
from service.loader.placement.memory import MemorySnapshot
from service.loader.placement.params import PlacementParams, SplitMode

logger = logging.getLogger(__name__)


def select_devices(devices: Sequence[Device], params: PlacementParams) -> list[Device]:
    """The offload devices, in order: remote (emulated) devices first, then GPUs
    de-duplicated by device id, then integrated GPUs only when there is no GPU; CPU and
    accelerator devices are never in this list. Split mode ``none`` keeps only
    ``main_gpu`` (none at all when it is negative).

    Raises:
        PlacementError: split mode ``none`` with ``main_gpu`` out of range.
    """
    remote: list[Device] = []
    gpus: list[Device] = []
    igpus: list[Device] = []
    for dev in devices:
        if dev.type == "GPU" and dev.remote:
            remote.append(dev)
        elif dev.type == "GPU":
            same = next((g for g in gpus if dev.device_id and g.device_id == dev.device_id), None)
            if same is not None:
                logger.info("skipping device %s with id %s - already using %s", dev.name, dev.device_id, same.name)
            else:
                gpus.append(dev)
        elif dev.type == "IGPU" and (not igpus or igpus[-1].backend == dev.backend):
            igpus.append(dev)
    chosen = remote + gpus + (igpus if not gpus else [])
    if params.split_mode is SplitMode.NONE and chosen:
        if params.main_gpu < 0:
            return []
        if params.main_gpu >= len(chosen):
            raise PlacementError(f"invalid value for main_gpu: {params.main_gpu} (available devices: {len(chosen)})")
        return [chosen[params.main_gpu]]
    return chosen


def split_points(
    devices: Sequence[Device], tensor_split: Sequence[float] | None, host: Device, memory: MemorySnapshot
) -> list[float]:
    """Cumulative, normalised split points, one per device (the last is 1.0).

    Without ``tensor_split`` (or all zero) each device weighs its free memory in
    ``memory``, the host's when a device reports 0/0. A zero sum gives a uniform split.

    Raises:
        PlacementError: more ``tensor_split`` values than devices, or a device missing
            from ``memory``.
    """
    n = len(devices)
    if tensor_split is not None and len(tensor_split) > n:
        raise PlacementError(
            f"tensor_split has {len(tensor_split)} values but {n} device{'s' if n != 1 else ''} "
            f"{'are' if n != 1 else 'is'} used"
        )
    if tensor_split is None or not any(tensor_split):
        weights = []
        for dev in devices:
            mem = memory.of(dev.name)
            if mem.free == 0 and mem.total == 0:
                mem = memory.of(host.name)
            weights.append(float(mem.free))
    else:
        weights = [float(x) for x in tensor_split] + [0.0] * (n - len(tensor_split))
    # float32 arithmetic throughout, as llama.cpp computes the split points in float
    points = []
    total = np.float32(0)
    for w in weights:
        total = np.float32(total + np.float32(w))
        points.append(total)
    if total == 0:
        return [float(np.float32(i + 1) / np.float32(n)) for i in range(n)]
    return [float(np.float32(p / total)) for p in points]


def layer_device(il: int, n_layer: int, n_gpu_layers: int, devices: Sequence[Device], points: Sequence[float]) -> int:
    """The device index of layer ``il`` (0..n_layer; ``n_layer`` is the output layer), or
    -1 for the CPU: ``i_gpu_start = max(n_layer + 1 - ngl, 0)``,
    ``act = min(ngl, n_layer + 1)`` (0 without devices); the CPU below ``i_gpu_start``
    or past ``act`` layers, else ``upper_bound(points, (il - i_gpu_start) / act)``."""
    i_gpu_start = max(n_layer + 1 - n_gpu_layers, 0)
    act = min(n_gpu_layers, n_layer + 1) if devices else 0
    if il < i_gpu_start or il - i_gpu_start >= act:
        return -1
    ratio = float(np.float32(il - i_gpu_start) / np.float32(act))
    return min(bisect.bisect_right(points, ratio), len(devices) - 1)
