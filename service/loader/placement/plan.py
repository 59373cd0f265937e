"""``plan``: where every tensor of a model goes, decided before any tensor data is read
(llama.cpp's device selection, ``load_tensors`` and ``create_tensor``), as data.

The same function serves a dry run (``hoist plan``, ``POST /v1/plans``) and a load, so
what a plan says is what a load allocates.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from service.cancel import CancelToken, check
from service.errors import MetadataError, PlacementError, TensorInfoError
from service.loader.devices import BufferType, Device, DeviceMemory
from service.loader.placement.buffers import BufferPlan, MiB, TensorPlacement, build_buffers
from service.loader.placement.bufts import BuftList, cpu_buft_list, gpu_buft_list, select_weight_buft
from service.loader.placement.devices import layer_device, select_devices, split_points
from service.loader.placement.memory import MemorySnapshot
from service.loader.placement.overrides import MATCH_BUDGET_SECONDS, OverrideMatcher
from service.loader.placement.params import (
    LAZY_AUTO_MIN_NBYTES,
    LAZY_ELIGIBLE,
    LazyMode,
    LoadMode,
    PlacementParams,
)
from service.loader.tensor_classes import ArchitectureTable, LayerClass, TensorClass, table_for
from service.loader.weights import LLAMA_MAX_LAYERS, WeightIndex

logger = logging.getLogger(__name__)

OVERRIDE_CPU_WITH_MMAP = (
    "tensor overrides to CPU are used with mmap enabled - consider using --load-mode none for better performance"
)


_INPUT, _OUTPUT, _REPEATING = LayerClass.INPUT.value, LayerClass.OUTPUT.value, LayerClass.REPEATING.value
"""The layer classes as a :class:`TensorPlacement` gives them (strings)."""

BIG_ENDIAN_WARNING = (
    "the file is big-endian: it can be planned but not loaded; convert it with gguf-py's "
    "`gguf-convert-endian FILE little`"
)


@dataclass(frozen=True, slots=True)
class MovedTensors:
    """Tensors that could not use the first buffer type of their list (llama.cpp logs
    the first of them and how many others)."""

    count: int
    first_tensor: str
    first_type: str
    from_buffer_type: str
    to_buffer_type: str

    def line(self) -> str:
        return (
            f"tensor '{self.first_tensor}' ({self.first_type}) (and {self.count - 1} others) cannot be used "
            f"with preferred buffer type {self.from_buffer_type}, using {self.to_buffer_type} instead"
        )


@dataclass(frozen=True, slots=True)
class DeviceUse:
    """What the plan allocates in one device's memory.

    Attributes:
        device: the device (``CPU`` for host memory, host buffer types included).
        allocated: bytes the plan allocates there.
        mapped: bytes wrapped from file mappings there (CPU only; not allocated).
        free: the device's free memory when planned (the host's, for a device that reports
            0/0 memory).
        total: the device's total memory (0 when it reports none).
        locked: the mapped bytes are locked in memory too (``mmap+mlock``), so they count.
        fits: what the device must hold is at most its free memory.
    """

    device: str
    allocated: int
    mapped: int
    free: int
    total: int
    locked: bool = False

    @property
    def needed(self) -> int:
        """Bytes the device must hold: what is allocated, and mapped bytes that are locked."""
        return self.allocated + (self.mapped if self.locked else 0)

    @property
    def fits(self) -> bool:
        return self.needed <= self.free

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "allocated_bytes": self.allocated,
            "mapped_bytes": self.mapped,
            "free_bytes": self.free,
            "total_bytes": self.total,
            "locked_mapped": self.locked,
            "fits": self.fits,
        }


@dataclass(frozen=True)
class Plan:
    """A complete placement.

    Attributes:
        load_mode: the load mode asked for; ``use_mmap`` is what it resolved to.
        lazy_mode: the lazy mode in effect (``auto`` becomes ``off`` when a chosen device
            cannot use mapped memory).
        n_layer: repeating layers of the model.
        n_gpu_layers: layers to offload, counting the output layer (``-ngl``).
        devices: the offload devices, in order.
        splits: cumulative split points, one per device.
        layers: ``input``, ``blk.0`` ... ``output`` -> device name.
        tensors: every placed tensor in load order (the tied output copy included).
        buffers: the model buffers, in the order llama.cpp prints them.
        moved: tensors that fell back from their preferred buffer type, if any.
        override_matches: tensors each ``-ot`` override placed, in override order.
        warnings: warnings for the user.
        device_use: allocation per device against its free memory.
        show_offload: whether llama.cpp would print the offload lines (a GPU backend exists).
    """

    model: str
    load_mode: LoadMode
    use_mmap: bool
    lazy_mode: LazyMode
    n_layer: int
    n_gpu_layers: int
    devices: tuple[str, ...]
    splits: tuple[float, ...]
    layers: dict[str, str]
    tensors: tuple[TensorPlacement, ...]
    buffers: tuple[BufferPlan, ...]
    moved: MovedTensors | None
    override_matches: tuple[int, ...]
    warnings: tuple[str, ...]
    device_use: tuple[DeviceUse, ...]
    show_offload: bool = True
    overrides: tuple[str, ...] = field(default_factory=tuple)

    @property
    def effective_load_mode(self) -> LoadMode:
        """The load mode in effect: ``auto`` resolved to ``mmap`` or ``none``, any other
        mode as asked."""
        if self.load_mode is LoadMode.AUTO:
            return LoadMode.MMAP if self.use_mmap else LoadMode.NONE
        return self.load_mode

    @property
    def load_mode_label(self) -> str:
        """The load mode by its ``-lm`` name, ``auto`` with what it resolved to
        (``auto -> mmap``)."""
        if self.load_mode is LoadMode.AUTO:
            return f"{LoadMode.AUTO.value} -> {self.effective_load_mode.value}"
        return self.load_mode.value

    @property
    def fits(self) -> bool:
        """Whether every device's free memory holds what the plan allocates there."""
        return all(u.fits for u in self.device_use)

    def offload_lines(self) -> list[str]:
        """llama.cpp's offload lines (``offloading K repeating layers to GPU`` undercounts
        by one when -ngl exceeds n_layer; llama.cpp prints it so)."""
        if not self.show_offload:
            return []
        n_gpu = min(self.n_gpu_layers, self.n_layer)
        lines = []
        if n_gpu > 0:
            lines.append("offloading output layer to GPU")
            n_gpu -= 1
        lines.append(f"offloading {n_gpu} repeating layers to GPU")
        lines.append(f"offloaded {min(self.n_gpu_layers, self.n_layer + 1)}/{self.n_layer + 1} layers to GPU")
        return lines

    def buffer_lines(self) -> list[str]:
        """``%12s model buffer size = %8.2f MiB`` per buffer."""
        return [f"{b.name:>12} model buffer size = {b.nbytes / MiB:8.2f} MiB" for b in self.buffers]

    def lines(self) -> list[str]:
        """The offload lines then the buffer lines."""
        return self.offload_lines() + self.buffer_lines()

    def to_dict(self, *, tensors: bool = True) -> dict[str, Any]:
        """The plan as JSON-ready data (``tensors``: include every tensor's placement)."""
        data: dict[str, Any] = {
            "model": self.model,
            "load_mode": self.load_mode.value,
            "effective_load_mode": self.effective_load_mode.value,
            "use_mmap": self.use_mmap,
            "lazy_mode": self.lazy_mode.value,
            "lazy_tensors": [t.name for t in self.tensors if t.lazy],
            "n_layer": self.n_layer,
            "n_gpu_layers": self.n_gpu_layers,
            "devices": list(self.devices),
            "splits": list(self.splits),
            "layers": self.layers,
            "buffers": [b.to_dict() for b in self.buffers],
            "devices_memory": [u.to_dict() for u in self.device_use],
            "fits": self.fits,
            "moved_tensors": None
            if self.moved is None
            else {
                "count": self.moved.count,
                "first": self.moved.first_tensor,
                "from": self.moved.from_buffer_type,
                "to": self.moved.to_buffer_type,
                "line": self.moved.line(),
            },
            "overrides": [
                {"override": o, "matched": n} for o, n in zip(self.overrides, self.override_matches, strict=True)
            ],
            "warnings": list(self.warnings),
            "offload_lines": self.offload_lines(),
            "lines": self.lines(),
        }
        if tensors:
            data["tensors"] = [t.to_dict() for t in self.tensors]
        return data


def model_n_layer(index: WeightIndex, classes: Mapping[str, TensorClass] | None = None) -> int:
    """Repeating layers: ``<arch>.block_count``, at least one past the highest layer a
    repeating weight belongs to (``classes``: each weight's class; None: classified here).

    Raises:
        MetadataError: ``<arch>.block_count`` is above llama.cpp's ``LLAMA_MAX_LAYERS``.
        TensorInfoError: a tensor names a layer at or above ``LLAMA_MAX_LAYERS``.
    """
    meta = index.metadata
    arch = meta.get("general.architecture")
    key = f"{arch}.block_count"
    entry = meta.kv.get(key) if isinstance(arch, str) else None
    declared = entry.value if entry is not None else None
    n = declared if isinstance(declared, int) and not isinstance(declared, bool) and declared >= 0 else 0
    if n > LLAMA_MAX_LAYERS:
        assert entry is not None
        raise MetadataError(
            f"'{key}' is {n}; llama.cpp loads at most {LLAMA_MAX_LAYERS} layers",
            path=meta.path,
            key=key,
            offset=entry.offset,
        )
    if classes is None:
        table = table_for(arch if isinstance(arch, str) else None)
        classes = {w: table.classify(w) for w in index.weights}
    highest, name = max(
        ((c.block, w) for w, c in classes.items() if c.block is not None and c.layer_class is LayerClass.REPEATING),
        default=(-1, ""),
    )
    if highest >= LLAMA_MAX_LAYERS:
        raise TensorInfoError(
            f"tensor '{name}' is in layer {highest}; llama.cpp loads at most {LLAMA_MAX_LAYERS} layers",
            path=index.files[index.weights[name].file_index].path,
            tensor=name,
            offset=index.weights[name].info.info_offset,
        )
    return max(n, highest + 1)


def _table_warnings(table: ArchitectureTable, index: WeightIndex, classes: Mapping[str, TensorClass]) -> list[str]:
    """Where llama.cpp would refuse the file or ignore tensors (see tensor_classes)."""
    out = []
    if not table.known:
        what = "names no architecture" if table.architecture is None else f"has architecture '{table.architecture}'"
        out.append(
            f"the file {what}, which llama.cpp cannot load (unknown model architecture); "
            "its tensors are classified by their names"
        )
    else:
        strays = [w for w, c in classes.items() if c.source != "architecture"]
        if strays:
            more = f" (and {len(strays) - 1} others)" if len(strays) > 1 else ""
            out.append(
                f"tensor '{strays[0]}'{more} is not one llama.cpp's '{table.architecture}' loader creates; "
                "llama.cpp refuses such a file (wrong number of tensors); classified by name"
            )
    unused = [w for w, c in classes.items() if c.unused]
    if unused:
        more = f" (and {len(unused) - 1} others)" if len(unused) > 1 else ""
        out.append(
            f"model has unused tensor {unused[0]} (size = {index.weights[unused[0]].nbytes} bytes){more} -- ignoring"
        )
    return out


def resolve_mmap(load_mode: LoadMode, devices: Sequence[Device]) -> bool:
    """Whether the file is mapped: ``auto`` maps unless a chosen device cannot use
    mapped memory."""
    maps = load_mode.maps
    if maps is None:
        return all(d.caps.mmap_support for d in devices)
    return maps


def plan(
    index: WeightIndex,
    devices: Sequence[Device],
    params: PlacementParams,
    *,
    memory: MemorySnapshot,
    cancel: CancelToken | None = None,
    match_budget_s: float | None = MATCH_BUDGET_SECONDS,
) -> Plan:
    """Place every tensor of ``index`` on ``devices`` as llama.cpp would.

    Each weight's layer class, op and layer come from llama.cpp's tensor table for the
    file's ``general.architecture`` (:mod:`service.loader.tensor_classes`); weights llama.cpp
    ignores (op ``NONE``) are not placed; files llama.cpp would refuse for their
    architecture or tensor names are planned all the same, with a warning.

    Pure: a function of the metadata, the devices' fixed properties, ``params`` and
    ``memory``; reads no live memory figures, allocates nothing.

    Args:
        index: the model.
        devices: every device of the process (one of them the CPU).
        params: the placement flags.
        memory: the devices' memory, read once by the caller
            (``MemorySnapshot.take(devices)``): it weighs the split and decides ``fits``.
        cancel: checked for every tensor, so that a plan can be abandoned.
        match_budget_s: seconds the ``-ot`` patterns may take to match every tensor
            name together (None: no budget; each match has its own time limit anyway).

    Returns:
        The :class:`Plan`.

    Raises:
        PlacementError: invalid ``main_gpu``, too many ``tensor_split`` values, split mode
            ``row`` on a device without split buffers, an override to a buffer type no
            device has, a tensor no buffer type accepts, a tensor larger than its
            device's largest allocation, or a device missing from ``memory``.
        MetadataError, TensorInfoError: the model declares or names more layers than
            llama.cpp's ``LLAMA_MAX_LAYERS``.
        WorkLimitError: the overrides took longer than ``match_budget_s`` to match.
        RequestAbandonedError: from ``cancel``.
    """
    cpu = next((d for d in devices if d.type == "CPU"), None)
    if cpu is None:
        raise PlacementError("no CPU device")
    chosen = select_devices(devices, params)
    use_mmap = resolve_mmap(params.load_mode, chosen)
    cpu_list = cpu_buft_list(devices, chosen, no_host=params.no_host)
    gpu_lists = {d.name: gpu_buft_list(d, params.split_mode, cpu_list) for d in chosen}
    points = split_points(chosen, params.tensor_split, cpu, memory)
    arch = index.metadata.get("general.architecture")
    table = table_for(arch if isinstance(arch, str) else None)
    classes: dict[str, TensorClass] = {}
    for name in index.weights:
        check(cancel)
        classes[name] = table.classify(name)
    n_layer = model_n_layer(index, classes)
    ngl = n_layer + 1 if params.n_gpu_layers is None else params.n_gpu_layers

    def layer_list(il: int) -> tuple[Device, BuftList]:
        k = layer_device(il, n_layer, ngl, chosen, points)
        return (cpu, cpu_list) if k < 0 else (chosen[k], gpu_lists[chosen[k].name])

    # each repeating layer's name and list, then the output layer's (n_layer is bounded
    # by LLAMA_MAX_LAYERS, and every repeating weight's block is below it)
    layer_names = [f"blk.{il}" for il in range(n_layer)]
    layer_lists = [layer_list(il) for il in range(n_layer + 1)]
    layers = {"input": cpu.name}
    layers.update({layer_names[il]: layer_lists[il][0].name for il in range(n_layer)})
    output_dev, output_list = layer_lists[n_layer]
    layers["output"] = output_dev.name

    bufts: dict[str, tuple[Device, BufferType]] = {}
    for dev in devices:
        # -ot names device default buffer types; other types join as tensors use them
        bufts.setdefault(dev.default_buffer_type.name, (dev, dev.default_buffer_type))
    overrides = params.overrides
    for o in overrides:
        if o.buffer_type not in bufts:
            raise PlacementError(f"unknown buffer type '{o.buffer_type}' in tensor override '{o.pattern}'")
    matcher = OverrideMatcher([o.pattern for o in overrides], budget_s=match_budget_s, cancel=cancel)
    warnings: list[str] = []
    if index.byte_order != "little":
        warnings.append(BIG_ENDIAN_WARNING)
    warnings += _table_warnings(table, index, classes)
    moved: list[tuple[str, str, str, str]] = []

    def choose(name: str, ggml_type: str, op: str, buft_list: BuftList) -> tuple[Device, BufferType, int | None]:
        chosen_buft: tuple[Device, BufferType] | None = None
        which = matcher.first(name)
        if which is not None:
            target = bufts[overrides[which].buffer_type]
            if target[1] is cpu.default_buffer_type:
                # an override to CPU still selects within the CPU list
                chosen_buft = select_weight_buft(cpu_list, op, ggml_type)
                if use_mmap and OVERRIDE_CPU_WITH_MMAP not in warnings:
                    warnings.append(OVERRIDE_CPU_WITH_MMAP)
            else:
                chosen_buft = target
        if chosen_buft is None:
            chosen_buft = select_weight_buft(buft_list, op, ggml_type)
            if chosen_buft is None:
                raise PlacementError(f"failed to find a compatible buffer type for tensor {name}", tensor=name)
        dev, buft = chosen_buft
        if use_mmap and dev.host_buffer_type is buft:
            # a pinned copy of mapped data would only waste memory
            dev, buft = cpu, cpu.default_buffer_type
        preferred = buft_list[0][1]
        if buft is not preferred:
            moved.append((name, ggml_type, preferred.name, buft.name))
        return dev, buft, which

    lazy_mode = params.lazy_mode
    if lazy_mode is LazyMode.AUTO and not all(d.caps.mmap_support for d in chosen):
        lazy_mode = LazyMode.OFF

    placed: list[TensorPlacement] = []
    for w in index.weights.values():
        check(cancel)
        cls = classes[w.name]
        if cls.unused:
            continue  # llama.cpp loads no data for it
        lazy = (
            w.name in LAZY_ELIGIBLE
            and lazy_mode is not LazyMode.OFF
            and (lazy_mode is LazyMode.ON or w.nbytes > LAZY_AUTO_MIN_NBYTES)
        )
        if cls.layer_class is LayerClass.INPUT:
            layer, layer_class, buft_list = "input", _INPUT, cpu_list
        elif cls.layer_class is LayerClass.OUTPUT:
            layer, layer_class, buft_list = "output", _OUTPUT, output_list
        else:
            block = cls.block or 0
            layer, layer_class, buft_list = layer_names[block], _REPEATING, layer_lists[block][1]
        ggml_type = w.info.ggml_type.name
        if lazy:
            # read on demand from the mapping, on the CPU whatever -ngl says
            dev, buft, which = cpu, cpu.default_buffer_type, None
        else:
            dev, buft, which = choose(w.name, ggml_type, cls.op, buft_list)
        placed.append(
            TensorPlacement(
                w.name, ggml_type, w.nbytes, w.file_index, w.offset, layer, layer_class, cls.op,
                dev.name if not buft.is_host else "CPU", buft.name, override=which, lazy=lazy,
            )
        )  # fmt: skip
        bufts[buft.name] = (dev, buft)

    if table.tied_output and "output.weight" not in index.weights and "token_embd.weight" in index.weights:
        # tied output: token_embd.weight also serves as the output weight; on another
        # buffer type than its input copy it is a second tensor there
        w = index.weights["token_embd.weight"]
        ggml_type = w.info.ggml_type.name
        dev, buft, which = choose(w.name, ggml_type, "MUL_MAT", output_list)
        first = next(t for t in placed if t.name == w.name)
        if buft.name != first.buffer_type:
            placed.append(
                TensorPlacement(
                    w.name, ggml_type, w.nbytes, w.file_index, w.offset, "output", _OUTPUT,
                    "MUL_MAT", dev.name if not buft.is_host else "CPU", buft.name, role="tied_output", override=which,
                )
            )  # fmt: skip
            bufts[buft.name] = (dev, buft)

    direct = params.load_mode is LoadMode.DIRECT_IO
    buffers = build_buffers(index, placed, bufts, use_mmap=use_mmap, direct=direct, cancel=cancel)
    use: dict[str, list[int]] = {}
    for buf in buffers:
        entry = use.setdefault(buf.memory, [0, 0])
        if buf.mapped:
            entry[1] += buf.nbytes
        else:
            entry[0] += buf.alloc_nbytes
    known = {d.name for d in devices}
    locks_mapping = params.load_mode is LoadMode.MMAP_MLOCK
    device_use = []
    for name, (allocated, mapped) in use.items():
        mem = memory.of(name if name in known else cpu.name)
        if mem.total == 0:
            # a device that reports no memory holds what fits in the host's
            mem = DeviceMemory(memory.of(cpu.name).free, 0)
        device_use.append(
            DeviceUse(name, allocated, mapped, mem.free, mem.total, locked=locks_mapping and name == cpu.name)
        )
    moved_info = None
    if moved:
        name, ggml_type, src, dst = moved[0]
        moved_info = MovedTensors(len(moved), name, ggml_type, src, dst)
    for k, n in enumerate(matcher.matches):
        if n == 0:
            o = overrides[k]
            warnings.append(f"tensor override {k} ('{o.pattern}={o.buffer_type}') matched 0 tensors")
    return Plan(
        model=index.path,
        load_mode=params.load_mode,
        use_mmap=use_mmap,
        lazy_mode=lazy_mode,
        n_layer=n_layer,
        n_gpu_layers=ngl,
        devices=tuple(d.name for d in chosen),
        splits=tuple(points),
        layers=layers,
        tensors=tuple(placed),
        buffers=tuple(buffers),
        moved=moved_info,
        override_matches=tuple(matcher.matches),
        warnings=tuple(warnings),
        device_use=tuple(device_use),
        show_offload=any(d.type in ("GPU", "IGPU") for d in devices),
        overrides=tuple(f"{o.pattern}={o.buffer_type}" for o in overrides),
    )
