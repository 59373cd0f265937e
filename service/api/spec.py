"""A load request as one typed value, from the API to the job runner: the model path,
the name it is hosted under, the placement flags, how the bytes move and how long it
stays resident; and the key under which loads share a resident copy."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from service.api.callbacks import CallbackSpec
from service.errors import RequestError, clip
from service.loader.pipeline.options import LoadOptions

if TYPE_CHECKING:
    from service.loader.placement import PlacementParams, Plan
    from service.loader.weights import WeightIndex

MAX_NAME = 256
"""Longest model name, in characters."""

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._:@+/-]*")

_JOB_ID = re.compile(r"lj_[0-9]*[0-9a-f]{8}")
"""What a load job's id looks like (models are found by id before name)."""


def check_name(name: str, *, what: str = "name") -> str:
    """``name`` if it can name a model: 1 to :data:`MAX_NAME` characters of ASCII
    letters, digits and ``. _ : @ + / -``, starting with a letter, digit or ``_``, with no
    empty, ``.`` or ``..`` segment between slashes, not ``ready`` nor ending in ``/ready``
    or ``/hashes`` (those paths are the model's readiness and tensor hashes) and not shaped
    like a load job's id (``lj_...``).

    Raises:
        RequestError: naming what is wrong.
    """
    if not name or len(name) > MAX_NAME:
        raise RequestError(f"model {what} must have 1 to {MAX_NAME} characters (has {len(name)})")
    if not _NAME.fullmatch(name):
        raise RequestError(
            f"model {what} {clip(ascii(name), 100)} may hold only ASCII letters, digits and '. _ : @ + / -', "
            "starting with a letter, digit or '_'",
            hint="give the load a 'name'" if what == "default name" else None,
        )
    if _JOB_ID.fullmatch(name):
        raise RequestError(
            f"model {what} {name!r} looks like a load job's id, by which models are found too",
            hint="give the load another 'name'",
        )
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts) or parts[-1] == "ready" or (len(parts) > 1 and parts[-1] == "hashes"):
        raise RequestError(
            f"model {what} {clip(name, 100)!r} has an empty, '.' or '..' part, is 'ready', "
            "or ends in '/ready' or '/hashes'",
            hint="give the load a 'name'" if what == "default name" else None,
        )
    return name


@dataclass(frozen=True, slots=True)
class PlacementFlags:
    """llama.cpp's placement flags as a request gives them (``make_params`` resolves
    them against the devices' buffer types)."""

    n_gpu_layers: int | str | None = None
    split_mode: str = "layer"
    main_gpu: int = 0
    tensor_split: tuple[float, ...] | str | None = None
    override_tensor: tuple[str, ...] = ()
    no_host: bool = False
    load_mode: str = "auto"
    lazy_mode: str = "auto"

    @classmethod
    def of(cls, **flags: Any) -> PlacementFlags:
        """From keyword flag values (lists become tuples; enum members their value)."""
        out: dict[str, Any] = {}
        for key, value in flags.items():
            if isinstance(value, list):
                value = tuple(value)
            elif hasattr(value, "value") and isinstance(value.value, str):
                value = value.value
            out[key] = value
        return cls(**out)

    def params(self, buffer_types: Sequence[str]) -> PlacementParams:
        """The placement parameters. Raises RequestError or PlacementError."""
        from service.loader.placement.params import make_params

        return make_params(
            buffer_types,
            n_gpu_layers=self.n_gpu_layers,
            split_mode=self.split_mode,
            main_gpu=self.main_gpu,
            tensor_split=self.tensor_split,
            override_tensor=self.override_tensor,
            no_host=self.no_host,
            load_mode=self.load_mode,
            lazy_mode=self.lazy_mode,
        )


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """One load request.

    Attributes:
        model: the model file (or its first split), relative to the models directory.
        name: the name to host it under; None for the default (the model path).
        flags: the placement flags.
        options: how the bytes move (staging, check-tensors).
        keep_alive_s: seconds it stays resident after this load (0: unloaded at once,
            negative: until unloaded); None for the service's default.
        callback: where its events are POSTed, if anywhere.
    """

    model: str
    name: str | None = None
    flags: PlacementFlags = field(default_factory=PlacementFlags)
    options: LoadOptions = field(default_factory=LoadOptions)
    keep_alive_s: float | None = None
    callback: CallbackSpec | None = None

    @classmethod
    def of(
        cls,
        model: str,
        *,
        name: str | None = None,
        options: LoadOptions | None = None,
        keep_alive_s: float | None = None,
        **flags: Any,
    ) -> LoadSpec:
        """A spec from keyword placement flags (as :class:`PlacementFlags` names them)."""
        return cls(model, name, PlacementFlags.of(**flags), options or LoadOptions(), keep_alive_s)


ShareKey = tuple[Any, ...]
"""What two loads must have alike to share one resident copy."""


def share_key(index: WeightIndex, params: PlacementParams, placement: Plan) -> ShareKey:
    """The files (device, inode, size, modification time of every split) and the
    resolved placement: load mode and lazy mode in effect, offloaded layers, devices,
    split mode, main device, proportions (normalised), overrides and ``no_host``. Two
    requests that spell the same placement differently (``-ngl all`` and ``-ngl 999``,
    ``-ts 3,1`` and ``-ts 6,2``, ``-lm auto`` resolved to ``mmap`` and ``-lm mmap``) get
    the same key."""
    # -ngl beyond the layers there are offloads them all; without a GPU it offloads nothing
    n_gpu_layers = min(placement.n_gpu_layers, placement.n_layer + 1) if placement.devices else 0
    split = params.tensor_split
    total = sum(split) if split else 0.0
    proportions = tuple(round(x / total, 9) for x in split) if split and total > 0 else None
    return (
        tuple(f.identity for f in index.files),
        placement.effective_load_mode.value,
        placement.lazy_mode.value,
        n_gpu_layers,
        placement.devices,
        params.split_mode.value,
        params.main_gpu,
        proportions,
        params.overrides,
        params.no_host,
    )
