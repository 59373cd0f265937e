"""The pipeline's entry points (re-exported by the package): :func:`load_model` and
:func:`load_plan`, the checks made before a load (:func:`check_budget`,
:func:`check_loadable`, :func:`staging_nbytes`), and the loaded model assembled from
what the loader thread filled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from service.errors import BudgetExceededError, ByteOrderError, InvalidDataError, StorageError
from service.io.mapping import Mapping
from service.loader.devices import MAPPED_BUFFER_NAME, CPUDevice, Device
from service.loader.ggml_types import GGML_TYPES_BY_NAME, numpy_dtype, numpy_shape
from service.loader.model import BufferInfo, LoadedModel, LoadedTensor, MemoryReport
from service.loader.pipeline.boundary import LoaderSetup, run_loader
from service.loader.pipeline.layout import Resources, build, map_ahead
from service.loader.pipeline.options import LoadOptions, ProgressCallback
from service.loader.placement import (
    LazyMode,
    LoadMode,
    MemorySnapshot,
    PlacementParams,
    Plan,
    TensorPlacement,
    plan,
)
from service.loader.placement.params import LAZY_ELIGIBLE
from service.loader.placement.plan import resolve_mmap
from service.loader.weights import WeightIndex

__all__ = [
    "check_budget",
    "check_loadable",
    "staging_nbytes",
    "load_model",
    "load_plan",
]

MiB = 1 << 20


def check_budget(p: Plan, *, staging: int = 0) -> None:
    """Raise :class:`BudgetExceededError` with the per-device breakdown unless every
    device's free memory holds what ``p`` needs there (and the host, ``staging`` more
    bytes of staging buffers)."""
    needs = {u.device: u.needed for u in p.device_use}
    free = {u.device: u.free for u in p.device_use}
    if staging:
        needs["CPU"] = needs.get("CPU", 0) + staging
        free.setdefault("CPU", CPUDevice().memory().free)
    parts = [
        f"{d} needs {needs[d] / MiB:.2f} MiB{' (staging buffers included)' if d == 'CPU' and staging else ''}, "
        f"{free[d] / MiB:.2f} MiB free"
        for d in needs
        if needs[d] > free[d]
    ]
    if not parts:
        return
    raise BudgetExceededError(
        "the model does not fit: " + "; ".join(parts),
        path=p.model,
        hint="offload fewer layers (-ngl), change --tensor-split, use smaller staging buffers, or free memory",
    )


def check_loadable(index: WeightIndex) -> None:
    """Raise what makes ``index`` impossible to load whatever the placement.

    Raises:
        ByteOrderError: the file is big-endian (hoist loads little-endian data only).
    """
    if index.byte_order != "little":
        raise ByteOrderError(
            "the file is big-endian; hoist loads little-endian tensor data only",
            path=index.path,
            hint="convert it with gguf-py's `gguf-convert-endian FILE little`",
        )


def staging_nbytes(p: Plan, devices: Sequence[Device], options: LoadOptions) -> int:
    """Host bytes of the staging buffers a load of ``p`` sets up (N per device that
    uploads staged tensors), counted with direct I/O's 4096-byte alignment when it
    applies."""
    if p.use_mmap:
        return 0
    by_name = {d.name: d for d in devices}
    staged = {
        b.device
        for b in p.buffers
        if not b.mapped and not b.host and b.device in by_name and by_name[b.device].can_stage
    }
    alignment = 4096 if p.load_mode is LoadMode.DIRECT_IO else 1
    return len(staged) * options.staging_buffers * (options.staging_size(alignment) + alignment)


def _typed(raw: Any, t: TensorPlacement, ne: tuple[int, ...], known: dict[tuple[str, tuple[int, ...]], Any]) -> Any:
    """A numpy ``uint8`` view as the tensor's element type and shape; other array types
    (torch tensors on a GPU) stay raw bytes. ``known`` keeps the dtype and shape of each
    (type, shape) met (a model has few)."""
    if not isinstance(raw, np.ndarray):
        return raw
    key = (t.ggml_type, ne)
    found = known.get(key)
    if found is None:
        ggml_type = GGML_TYPES_BY_NAME[t.ggml_type]
        found = known[key] = (numpy_dtype(ggml_type), numpy_shape(ggml_type, ne))
    return raw.view(found[0]).reshape(found[1])


async def load_model(
    index: WeightIndex,
    *,
    load_mode: LoadMode | str = LoadMode.MMAP,
    devices: Sequence[Device] | None = None,
    params: PlacementParams | None = None,
    options: LoadOptions | None = None,
    on_progress: ProgressCallback | None = None,
    chunk_nbytes: int | None = None,
) -> LoadedModel:
    """Place and load every tensor of ``index`` (llama.cpp ``load_tensors`` +
    ``load_all_data``).

    Args:
        index: the model's weights index.
        load_mode: the load mode when ``params`` is not given (``mmap``, ``none``,
            ``mlock``, ``mmap+mlock``, ``direct-io``, ``auto``).
        devices: the devices to place on (default: the CPU alone).
        params: the placement flags (default: every layer offloaded, layer split).
        options: how bytes move (chunk size, staging buffers, check-tensors).
        on_progress: called on the event loop with :class:`Progress` after each chunk,
            with bytes done strictly increasing; returning ``False`` cancels the load.
        chunk_nbytes: shorthand for ``options.chunk_nbytes``.

    Returns:
        The :class:`LoadedModel`; the caller closes it.

    Raises:
        RequestError: unknown load mode.
        ByteOrderError: the file is big-endian.
        PlacementError: the flags give no valid placement.
        BudgetExceededError: the plan needs more memory than a device has free; nothing
            was allocated.
        OutOfMemoryError: an allocation failed.
        StorageError: a file cannot be opened, mapped or read, or it changed (shrank or
            was rewritten) during the load.
        InvalidDataError: with check-tensors, tensors hold NaN/Inf values or scales; the
            error lists every one.
        LoadCancelledError: the progress callback returned ``False``.
        asyncio.CancelledError: the awaiting task was cancelled.
        In every case nothing the load took stays held.
    """
    if params is None:
        mode = LoadMode.parse(load_mode) if isinstance(load_mode, str) else load_mode
        params = PlacementParams(load_mode=mode)
    opts = options or LoadOptions()
    if chunk_nbytes is not None:
        opts = replace(opts, chunk_nbytes=chunk_nbytes)
    check_loadable(index)
    chosen = list(devices) if devices is not None else [CPUDevice()]
    placed = params

    def planned() -> Plan:
        # on the loader thread: planning and loading without a hand-over between them
        placement = _plan_now(index, chosen, placed)
        check_budget(placement, staging=staging_nbytes(placement, chosen, opts))
        return placement

    # a mapped load without lazy tensors faults each file in whole (as llama.cpp does):
    # where nothing is read from disk, that can start before the plan
    early = resolve_mmap(params.load_mode, chosen) and (
        params.lazy_mode is LazyMode.OFF or not any(name in index.weights for name in LAZY_ELIGIBLE)
    )
    return await _load(
        index, planned, chosen, opts, on_progress, map_early=early, lock_early=params.load_mode is LoadMode.MMAP_MLOCK
    )


def _plan_now(index: WeightIndex, devices: Sequence[Device], params: PlacementParams) -> Plan:
    """Plan against the devices' memory as it is now (read once)."""
    return plan(index, devices, params, memory=MemorySnapshot.take(devices))


async def load_plan(
    index: WeightIndex,
    placement: Plan,
    devices: Sequence[Device],
    *,
    options: LoadOptions | None = None,
    on_progress: ProgressCallback | None = None,
) -> LoadedModel:
    """Load ``index`` as ``placement`` (from :func:`~service.loader.placement.plan`) says.

    Raises: as :func:`load_model`, but the plan is taken as it is (no budget check).
    """
    return await _load(index, lambda: placement, list(devices), options or LoadOptions(), on_progress)


Finished = tuple[dict[str, LoadedTensor], LoadedTensor | None]
"""The tensors of a finished load, by name, and the tied output's second copy."""


async def _load(
    index: WeightIndex,
    planned: Callable[[], Plan],
    devices: Sequence[Device],
    options: LoadOptions,
    on_progress: ProgressCallback | None,
    *,
    map_early: bool = False,
    lock_early: bool = False,
) -> LoadedModel:
    """Plan (``planned``, on the loader thread) and load; the body of :func:`load_model`
    and :func:`load_plan`. ``map_early``: the load maps its files whole, so the files
    wholly in the page cache are mapped and faulted in while it plans
    (:func:`~service.loader.pipeline.layout.map_ahead`); ``lock_early`` (``mmap+mlock``):
    they are locked on fault before that."""
    res = Resources()
    placements: list[Plan] = []

    def setup() -> LoaderSetup[Finished]:
        if map_early:
            map_ahead(index, res, lock=lock_early)
        placement = planned()
        placements.append(placement)
        return LoaderSetup(
            total=sum(t.nbytes for t in placement.tensors),
            device_of=[t.device for t in placement.tensors],
            identities={i: f.identity for i, f in enumerate(index.files)},
            direct=placement.load_mode is LoadMode.DIRECT_IO,
            data_ranges=_data_ranges(index, placement),
            prepare=lambda: _prepare(index, placement, devices, res),
            conclude=lambda: _finish_load(placement, res),
        )

    try:
        stats, invalid, hashes, finished = await run_loader(setup, res, options, on_progress)
        if invalid:
            # the error's traceback holds this frame: no view of what is released below
            # may stay in it
            del finished
            listed = "; ".join(f"tensor '{name}': {found.reason}" for name, found in invalid.items())
            raise InvalidDataError(
                f"found {len(invalid)} tensor{'s' if len(invalid) > 1 else ''} with invalid data: {listed}",
                path=index.path,
                tensors={name: found.reason for name, found in invalid.items()},
            )
    except BaseException:
        res.release()
        raise
    tensors, tied = finished
    res.jobs.clear()
    (placement,) = placements
    report = MemoryReport(
        tuple(BufferInfo(b.name, b.memory, b.nbytes, mapped=b.mapped, host=b.host) for b in placement.buffers)
    )
    warnings = [*placement.warnings, *res.warnings, *stats.notices]
    return LoadedModel(
        index,
        placement,
        tensors,
        report,
        res.release,
        tied_output=tied,
        warnings=warnings,
        stats=stats,
        mappings=list(res.mappings.values()),
        tensor_hashes=hashes,
    )


def _data_ranges(index: WeightIndex, placement: Plan) -> dict[int, tuple[str, int, int]]:
    """File index -> (path, first byte, end) of the tensor data the load brings in."""
    bounds: dict[int, list[int]] = {}
    for t in placement.tensors:
        if t.lazy or not t.nbytes:
            continue
        b = bounds.get(t.file_index)
        if b is None:
            bounds[t.file_index] = [t.offset, t.offset + t.nbytes]
            continue
        if t.offset < b[0]:
            b[0] = t.offset
        if t.offset + t.nbytes > b[1]:
            b[1] = t.offset + t.nbytes
    return {i: (index.files[i].path, lo, hi) for i, (lo, hi) in bounds.items()}


def _prepare(index: WeightIndex, placement: Plan, devices: Sequence[Device], res: Resources) -> None:
    """Build what the load needs (:func:`~service.loader.pipeline.layout.build`), then its
    tensors (:func:`_typed_tensors`)."""
    build(index, placement, devices, res)
    _typed_tensors(index, placement, res)


def _typed_tensors(index: WeightIndex, placement: Plan, res: Resources) -> None:
    """On the loader thread, once the buffers and jobs are built and before the bytes
    come in: every tensor with its typed view of its destination, put in
    ``res.loaded`` (so that a wait for the bytes, such as a populate in progress, is not
    followed by a pass over every tensor)."""
    tensors: dict[str, LoadedTensor] = {}
    tied: LoadedTensor | None = None
    mapped = {j.index for j in res.jobs if j.branch in ("mapped", "lazy")}
    known: dict[tuple[str, tuple[int, ...]], Any] = {}
    weights = index.weights
    views = res.views
    for i, t in enumerate(placement.tensors):
        ne = weights[t.name].info.ne
        buffer_type = MAPPED_BUFFER_NAME if i in mapped else t.buffer_type
        loaded = LoadedTensor(
            t.name, t.ggml_type, ne, t.nbytes, buffer_type, t.device, _typed(views[i], t, ne, known), t.lazy
        )
        if t.role == "tied_output":
            tied = loaded
        else:
            tensors[t.name] = loaded
    res.loaded = (tensors, tied)


def _finish_load(placement: Plan, res: Resources) -> Finished:
    """On the loader thread, after the last extent: fail if a mapped file changed during
    the load, unmap what no tensor uses, and give the tensors :func:`_typed_tensors`
    prepared (off the event loop: a model can have hundreds of thousands of tensors).

    Raises:
        StorageError: a mapped file changed (shrank or was rewritten) during the load.
    """
    for mapping in res.mappings.values():
        how = mapping.changed()
        if how is not None:
            raise StorageError(f"the file changed while it was mapped for the load: {how}", path=mapping.path)
    if placement.use_mmap:
        _unmap_unused(placement, res.mappings)
    loaded: Finished = res.loaded
    return loaded


def _unmap_unused(placement: Plan, mappings: dict[int, Mapping]) -> None:
    """Unmap each mapping's head and tail that no zero-copy tensor uses (page-aligned
    inward); a mapping no zero-copy tensor uses is unmapped entirely."""
    for file_index, mapping in mappings.items():
        used = [
            (placement.tensors[i].offset, placement.tensors[i].offset + placement.tensors[i].nbytes)
            for b in placement.buffers
            if b.mapped and b.file_index == file_index
            for i in b.tensors
        ]
        if not used:
            mapping.unmap_fragment(0, mapping.size)
            continue
        mapping.unmap_fragment(0, min(s for s, _ in used))
        mapping.unmap_fragment(max(e for _, e in used), mapping.size)
