"""Placement flags, as llama.cpp takes them (``-ngl``, ``-sm``, ``-mg``, ``-ts``, ``-ot``,
``--no-host``, ``-lm``)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from service.errors import PlacementError, RequestError, clip
from service.loader.modes import FlagValue as FlagValue  # re-exported: defined there since the CLI needs them alone
from service.loader.modes import LazyMode as LazyMode
from service.loader.modes import LoadMode as LoadMode
from service.loader.modes import SplitMode as SplitMode
from service.loader.placement.overrides import MAX_OVERRIDES, MAX_TOTAL_SIZE, compile_override, pattern_size

LAZY_ELIGIBLE = frozenset({"per_layer_token_embd.weight"})
"""Tensors read on demand when lazy reading applies (per-layer embedding tables)."""

LAZY_AUTO_MIN_NBYTES = 4 << 30
"""``auto`` reads a tensor on demand only above this size (4 GiB)."""


@dataclass(frozen=True, slots=True)
class TensorOverride:
    """One ``-ot PATTERN=BUFT``: tensors whose name matches ``pattern`` (searched, not
    anchored) go to buffer type ``buffer_type``."""

    pattern: str
    buffer_type: str


N_GPU_LAYERS_WORDS = ("auto", "all")
"""``-ngl`` words: llama.cpp stores ``auto`` as -1 and ``all`` as -2; both mean every
layer here, as in llama.cpp without ``--fit``."""

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
"""The range of llama.cpp's ``n_gpu_layers`` (an ``int32_t`` read with ``std::stoi``)."""

_INTEGER = re.compile(r"[+-]?[0-9]{1,12}")


def n_gpu_layers_error(value: object, reason: str = "") -> str:
    """The message refusing ``value`` as ``-ngl``."""
    why = f": {reason}" if reason else ""
    return (
        f"invalid n_gpu_layers '{clip(str(value), 50)}'{why} "
        f"(expected an integer from {INT32_MIN} to {INT32_MAX}, 'all' or 'auto')"
    )


def parse_n_gpu_layers(value: str | int | None) -> int | None:
    """``-ngl`` -> layers to offload, counting the output layer; None for every layer.

    Ports llama.cpp's ``-ngl`` parsing (``common/arg.cpp``: ``auto`` -> -1, ``all`` -> -2,
    else ``std::stoi``) and what its model loader makes of the number
    (``llama_model::n_gpu_layers``: a negative value means every layer, and a value past
    the layer count offloads them all): ``auto``, ``all`` and every negative number give
    None; 0 and above are taken as they are. Accepted text is an optional sign and ASCII
    digits; ``std::stoi`` would also skip leading blanks and stop at the first non-digit
    (``7.5`` -> 7), which hoist refuses rather than guesses.

    Raises:
        RequestError: anything else (another word, a fraction, a boolean, a value outside
            ``int32_t``, which ``std::stoi`` refuses too).
    """
    if value is None or value in N_GPU_LAYERS_WORDS:
        return None
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise RequestError(n_gpu_layers_error(value))
    if isinstance(value, str):
        if not _INTEGER.fullmatch(value):
            raise RequestError(n_gpu_layers_error(value))
        value = int(value)
    if not INT32_MIN <= value <= INT32_MAX:
        raise RequestError(n_gpu_layers_error(value, "out of range"))
    return None if value < 0 else value


MAX_DEVICES = 16
"""Most devices llama.cpp places on (``LLAMA_MAX_DEVICES``), so most ``-ts`` values."""

_MAX_SPLIT = 1e30
"""Largest ``-ts`` proportion: sums of a few stay finite in float32, as llama.cpp adds them."""


def parse_tensor_split(value: str | Sequence[float] | None) -> tuple[float, ...] | None:
    """``-ts 3,1`` (or a list of numbers) -> proportions; None when not given.

    Raises:
        RequestError: a value that is not a non-negative number.
    """
    if value is None:
        return None
    parts: Iterable[object] = value.replace("/", ",").split(",", MAX_DEVICES) if isinstance(value, str) else value
    out: list[float] = []
    for part in parts:
        if len(out) == MAX_DEVICES:
            raise RequestError(f"too many tensor_split values: at most {MAX_DEVICES} (one per device)")
        try:
            f = float(str(part).strip())
        except ValueError:
            raise RequestError(f"invalid tensor_split value '{clip(str(part), 50)}'") from None
        if not 0 <= f <= _MAX_SPLIT:
            raise RequestError(
                f"invalid tensor_split value '{clip(str(part), 50)}': proportions are numbers from 0 to {_MAX_SPLIT:g}"
            )
        out.append(f)
    return tuple(out) or None


def parse_overrides(values: Iterable[str], buffer_types: Sequence[str]) -> tuple[TensorOverride, ...]:
    """``-ot`` values (each ``PATTERN=BUFT[,PATTERN=BUFT...]``), checked against the
    buffer type names ``-ot`` accepts: each device's default buffer type (``CPU``,
    ``EMU0``, ``CUDA0``, ...).

    Raises:
        PlacementError: a value without ``=``, an invalid or too costly pattern (see
            :mod:`.overrides`), more than :data:`MAX_OVERRIDES` overrides, or an unknown
            buffer type (the message lists the available ones).
    """
    out: list[TensorOverride] = []
    total = 0
    for value in values:
        for item in value.split(","):
            if len(out) == MAX_OVERRIDES:
                raise PlacementError(f"too many tensor overrides: at most {MAX_OVERRIDES} are allowed")
            pattern, eq, buft = item.partition("=")
            if not eq or not pattern:
                raise PlacementError(f"invalid tensor override '{clip(item, 100)}' (expected PATTERN=BUFFER_TYPE)")
            if buft not in buffer_types:
                raise PlacementError(
                    f"unknown buffer type '{clip(buft, 100)}' in tensor override '{clip(item, 100)}'; "
                    f"available buffer types: {', '.join(buffer_types)}"
                )
            total += pattern_size(pattern)
            if total > MAX_TOTAL_SIZE:
                raise PlacementError(
                    f"the tensor override patterns expand to more than {MAX_TOTAL_SIZE} items together; "
                    "use fewer or simpler patterns"
                )
            compile_override(pattern)
            out.append(TensorOverride(pattern, buft))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class PlacementParams:
    """Everything that decides placement besides the model and the devices.

    Attributes:
        n_gpu_layers: layers to offload, counting the output layer; None for all.
        split_mode: how layers spread over devices.
        main_gpu: the device kept by split mode ``none`` (-1: no device at all).
        tensor_split: proportions per device; None (or all zero) to split by free memory.
        overrides: ``-ot`` overrides in order; the first that matches a tensor wins.
        no_host: leave the device's pinned host buffer type out of the CPU list.
        load_mode: the load mode (whether the file is mapped matters to placement).
        lazy_mode: which eligible tensors are read on demand.
    """

    n_gpu_layers: int | None = None
    split_mode: SplitMode = SplitMode.LAYER
    main_gpu: int = 0
    tensor_split: tuple[float, ...] | None = None
    overrides: tuple[TensorOverride, ...] = field(default_factory=tuple)
    no_host: bool = False
    load_mode: LoadMode = LoadMode.MMAP
    lazy_mode: LazyMode = LazyMode.AUTO


def make_params(
    buffer_types: Sequence[str],
    *,
    n_gpu_layers: str | int | None = None,
    split_mode: str = "layer",
    main_gpu: int = 0,
    tensor_split: str | Sequence[float] | None = None,
    override_tensor: Iterable[str] = (),
    no_host: bool = False,
    load_mode: str = "auto",
    lazy_mode: str = "auto",
) -> PlacementParams:
    """Placement parameters from llama.cpp-style flag values, as the CLI and the API take
    them. ``buffer_types`` are the names ``-ot`` may use (each device's default buffer
    type).

    Raises:
        RequestError: an invalid ``-ngl``, ``-sm``, ``-ts``, ``-lm`` or ``-lzm`` value.
        PlacementError: an invalid ``-ot`` override.
    """
    return PlacementParams(
        n_gpu_layers=parse_n_gpu_layers(n_gpu_layers),
        split_mode=SplitMode.parse(split_mode),
        main_gpu=main_gpu,
        tensor_split=parse_tensor_split(tensor_split),
        overrides=parse_overrides(override_tensor, buffer_types),
        no_host=no_host,
        load_mode=LoadMode.parse(load_mode),
        lazy_mode=LazyMode.parse(lazy_mode),
    )
