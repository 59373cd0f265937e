"""Placement flags, as llama.cpp takes them (``-ngl``, ``-sm``, ``-mg``, ``-ts``, ``-ot``,
``--no-host``, ``-lm``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeVar

import regex

from service.errors import PlacementError, RequestError, clip

E = TypeVar("E", bound=StrEnum)


def _member(cls: type[E], value: str, what: str) -> E:
    """The member of ``cls`` named ``value``. Raises RequestError listing the names."""
    try:
        return cls(value)
    except ValueError:
        known = ", ".join(m.value for m in cls)
        raise RequestError(f"unknown {what} '{value}' (expected one of: {known})") from None


class SplitMode(StrEnum):
    """How layers spread over several devices (``-sm``)."""

    NONE = "none"
    LAYER = "layer"
    ROW = "row"


class LoadMode(StrEnum):
    """How tensor data gets into memory (llama.cpp's ``-lm/--load-mode``)."""

    AUTO = "auto"
    NONE = "none"
    MMAP = "mmap"
    MLOCK = "mlock"
    MMAP_MLOCK = "mmap+mlock"
    DIRECT_IO = "direct-io"

    @classmethod
    def parse(cls, value: str) -> LoadMode:
        """The load mode named ``value`` (``dio`` as llama.cpp spells direct-io).

        Raises:
            RequestError: unknown name.
        """
        return cls.DIRECT_IO if value == "dio" else _member(cls, value, "load mode")

    @property
    def maps(self) -> bool | None:
        """True when the mode maps the file, False when it reads, None for ``auto``."""
        if self is LoadMode.AUTO:
            return None
        return self in (LoadMode.MMAP, LoadMode.MMAP_MLOCK)


class LazyMode(StrEnum):
    """On-demand reading of the tensors llama.cpp marks for it (``-lzm/--lazy-mode``):
    ``off`` keeps them resident, ``auto`` reads those larger than 4 GiB on demand, ``on``
    all of them."""

    OFF = "off"
    AUTO = "auto"
    ON = "on"

    @classmethod
    def parse(cls, value: str) -> LazyMode:
        """The lazy mode named ``value``. Raises RequestError."""
        return _member(cls, value, "lazy mode")


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


def parse_n_gpu_layers(value: str | int | None) -> int | None:
    """``-ngl``: a number, ``all`` or ``auto`` (both: every layer, as llama.cpp does
    without ``--fit``) -> layers, or None for every layer.

    Raises:
        RequestError: anything else.
    """
    if value is None or value in ("all", "auto"):
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return None if value < 0 else value
    try:
        n = int(str(value))
    except ValueError:
        raise RequestError(f"invalid n_gpu_layers '{value}' (expected a number, 'all' or 'auto')") from None
    return None if n < 0 else n


_MAX_SPLIT = 1e30
"""Largest ``-ts`` proportion: sums of a few stay finite in float32, as llama.cpp adds them."""


def parse_tensor_split(value: str | Sequence[float] | None) -> tuple[float, ...] | None:
    """``-ts 3,1`` (or a list of numbers) -> proportions; None when not given.

    Raises:
        RequestError: a value that is not a non-negative number.
    """
    if value is None:
        return None
    parts: Iterable[object] = value.replace("/", ",").split(",") if isinstance(value, str) else value
    out = []
    for part in parts:
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


OVERRIDE_MATCH_SECONDS = 0.25
"""Longest time one ``-ot`` pattern may take to match one tensor name."""


def compile_override(pattern: str) -> Any:
    """``pattern`` compiled (``regex``, re-compatible, matchable with a timeout and
    without holding the GIL).

    Raises:
        PlacementError: the pattern is invalid or too large to compile.
    """
    try:
        return regex.compile(pattern)
    except (regex.error, OverflowError, RecursionError, ValueError, MemoryError) as exc:
        raise PlacementError(f"invalid pattern '{clip(pattern, 200)}' in tensor override: {exc}") from None


def override_matches(compiled: Any, name: str) -> bool:
    """Whether ``compiled`` is found in ``name`` (searched, as llama.cpp's regex_search).

    Raises:
        PlacementError: the match takes longer than :data:`OVERRIDE_MATCH_SECONDS`
            (catastrophic backtracking).
    """
    try:
        return compiled.search(name, timeout=OVERRIDE_MATCH_SECONDS, concurrent=True) is not None
    except TimeoutError:
        raise PlacementError(
            f"tensor override pattern '{clip(compiled.pattern, 200)}' takes too long to match '{name}' "
            "(catastrophic backtracking); simplify it",
            tensor=name,
        ) from None


def parse_overrides(values: Iterable[str], buffer_types: Sequence[str]) -> tuple[TensorOverride, ...]:
    """``-ot`` values (each ``PATTERN=BUFT[,PATTERN=BUFT...]``), checked against the
    buffer type names ``-ot`` accepts: each device's default buffer type (``CPU``,
    ``EMU0``, ``CUDA0``, ...).

    Raises:
        PlacementError: a value without ``=``, an invalid pattern, or an unknown buffer
            type (the message lists the available ones).
    """
    out: list[TensorOverride] = []
    for value in values:
        for item in value.split(","):
            pattern, eq, buft = item.partition("=")
            if not eq or not pattern:
                raise PlacementError(f"invalid tensor override '{item}' (expected PATTERN=BUFFER_TYPE)")
            if buft not in buffer_types:
                raise PlacementError(
                    f"unknown buffer type '{buft}' in tensor override '{item}'; "
                    f"available buffer types: {', '.join(buffer_types)}"
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
    mode = _member(SplitMode, split_mode, "split mode")
    return PlacementParams(
        n_gpu_layers=parse_n_gpu_layers(n_gpu_layers),
        split_mode=mode,
        main_gpu=main_gpu,
        tensor_split=parse_tensor_split(tensor_split),
        overrides=parse_overrides(override_tensor, buffer_types),
        no_host=no_host,
        load_mode=LoadMode.parse(load_mode),
        lazy_mode=LazyMode.parse(lazy_mode),
    )
