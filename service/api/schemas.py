"""Request and response bodies of the HTTP API (pydantic, at the boundary only); the
problem+json body is :mod:`~service.api.problem_schema`'s (re-exported here), and the
probes' bodies are :mod:`~service.api.routes.health`'s, so that the probes are served
without building these models."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Annotated, Any, Literal, TypeAlias

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, field_validator

from service.api.callback_policy import MAX_CALLBACK_URL
from service.api.callbacks import DEFAULT_EVENTS, CallbackSpec
from service.api.keepalive import parse_keep_alive
from service.api.problem_schema import COMMON_PROBLEMS as COMMON_PROBLEMS
from service.api.problem_schema import Problem as Problem
from service.api.problem_schema import problem_responses as problem_responses
from service.api.spec import MAX_NAME, LoadSpec, PlacementFlags, check_name
from service.errors import RequestError
from service.loader.pipeline.options import LoadOptions
from service.loader.placement.overrides import MAX_OVERRIDES
from service.loader.placement.params import (
    INT32_MAX,
    INT32_MIN,
    MAX_DEVICES,
    N_GPU_LAYERS_WORDS,
    FlagValue,
    LazyMode,
    LoadMode,
    SplitMode,
    n_gpu_layers_error,
)

Int32 = Annotated[int, Field(ge=INT32_MIN, le=INT32_MAX)]


def _spelling(cls: type[FlagValue]) -> Callable[[object], object]:
    """A validator taking any spelling of ``cls`` (an alias too) to its member, so that
    the request holds the canonical name; the CLI takes the same spellings."""

    def parse(value: object) -> object:
        if not isinstance(value, str):
            return value  # a member already, or refused by the enum's own check
        try:
            return cls.parse(value)
        except RequestError as exc:
            raise ValueError(exc.message) from None

    return parse


def _spellings_schema(cls: type[FlagValue]) -> WithJsonSchema:
    """The OpenAPI schema of a flag value: a string, one of the accepted spellings."""
    return WithJsonSchema({"type": "string", "enum": list(cls.spellings())})


SplitModeIn: TypeAlias = Annotated[SplitMode, BeforeValidator(_spelling(SplitMode)), _spellings_schema(SplitMode)]
LoadModeIn: TypeAlias = Annotated[LoadMode, BeforeValidator(_spelling(LoadMode)), _spellings_schema(LoadMode)]
LazyModeIn: TypeAlias = Annotated[LazyMode, BeforeValidator(_spelling(LazyMode)), _spellings_schema(LazyMode)]


class PlanRequest(BaseModel):
    """Body of ``POST /v1/plans``: a model and llama.cpp's placement flags."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(
        min_length=1,
        max_length=4096,
        description="Path of the GGUF file (or its first split), relative to the models directory.",
    )
    n_gpu_layers: Int32 | Literal["all", "auto"] | None = Field(
        default=None,
        description="Layers to offload, counting the output layer (-ngl): an integer, 'all' or 'auto'; as in "
        "llama.cpp, a negative number, 'all' and 'auto' offload every layer. Default all.",
    )
    split_mode: SplitModeIn = Field(default=SplitMode.LAYER, description="-sm")
    main_gpu: Int32 = Field(default=0, description="-mg: the device kept by split mode none (-1: none).")
    tensor_split: (
        Annotated[list[float], Field(max_length=MAX_DEVICES)] | Annotated[str, Field(max_length=1024)] | None
    ) = Field(default=None, description="-ts: proportions per device.")
    override_tensor: list[Annotated[str, Field(max_length=16384)]] = Field(
        default_factory=list,
        max_length=MAX_OVERRIDES,
        description=f"-ot: PATTERN=BUFFER_TYPE items (each may hold several, comma-separated); the first match "
        f"wins. At most {MAX_OVERRIDES} patterns of at most 256 characters.",
    )
    no_host: bool = Field(default=False, description="--no-host: no pinned host buffer type for CPU layers.")
    load_mode: LoadModeIn = Field(
        default=LoadMode.AUTO,
        description="-lm: how tensor data gets into memory ('dio' is llama.cpp's spelling of 'direct-io'; responses "
        "give the canonical name).",
    )
    lazy_mode: LazyModeIn = Field(
        default=LazyMode.AUTO, description="-lzm: read per-layer embedding tables on demand (auto: above 4 GiB)."
    )

    @field_validator("n_gpu_layers", mode="before")
    @classmethod
    def _n_gpu_layers(cls, value: object) -> object:
        """Refuse what ``-ngl`` refuses that pydantic would coerce: ``true`` is not 1,
        and a string is one of the words (JSON gives numbers as numbers)."""
        if isinstance(value, bool) or (isinstance(value, str) and value not in N_GPU_LAYERS_WORDS):
            raise ValueError(n_gpu_layers_error(value))
        return value

    def flags(self) -> PlacementFlags:
        """The placement flags."""
        return PlacementFlags.of(**self.model_dump(include=set(PlanRequest.model_fields) - {"model"}))


class CallbackIn(BaseModel):
    """Where a load's events are POSTed (webhooks), as the job's event stream gives them."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(
        min_length=1,
        max_length=MAX_CALLBACK_URL,
        description="http or https URL without credentials, on a host HOIST_CALLBACK_HOSTS allows; redirects are "
        "not followed.",
    )
    events: list[Literal["snapshot", "progress", "state", "warning", "report", "error"]] | None = Field(
        default=None,
        max_length=16,
        description="Event types sent (default progress, state, warning, report, error).",
    )
    min_interval_s: float = Field(
        default=1.0, ge=0, le=3600, description="Least time between two progress deliveries, in seconds."
    )

    def spec(self) -> CallbackSpec:
        """The callback as the job manager takes it."""
        events = DEFAULT_EVENTS if self.events is None else frozenset(self.events)
        return CallbackSpec(self.url, events, self.min_interval_s)


class LoadRequest(PlanRequest):
    """Body of ``POST /v1/loads``: a plan's fields, and how the bytes move."""

    check_tensors: bool = Field(
        default=False, description="Validate tensor data (NaN/Inf values and block scales); lists every bad tensor."
    )
    hash_tensors: bool = Field(
        default=False,
        description="Compute an xxh3_64 digest of every tensor's bytes while loading (GET /v1/models/{name}/hashes).",
    )
    staging_buffers: int = Field(default=4, ge=1, le=64, description="Staging buffers per device for uploads.")
    staging_size: int | None = Field(
        default=None,
        ge=4096,
        le=1 << 30,
        description="Bytes per staging buffer (default 1 MiB, or 64 MiB with direct-io); at most 1 GiB.",
    )
    name: str | None = Field(
        default=None,
        max_length=MAX_NAME,
        description="The name to host the model under (default: the model path). ASCII letters, digits and "
        "'. _ : @ + / -'. A load under the name of a resident model with the same files and resolved placement "
        "shares it; with other files or another placement it is 409 (name_taken).",
    )
    keep_alive: Annotated[
        float | str | None,
        WithJsonSchema({"oneOf": [{"type": "number"}, {"type": "string", "maxLength": 64}], "default": None}),
    ] = Field(
        default=None,
        description="How long the model stays resident after this load, as Ollama's keep_alive: seconds, or a "
        "duration such as '5m' or '1h30m'; 0 unloads it once loaded, a negative value keeps it until unloaded. "
        "Default HOIST_KEEP_ALIVE.",
    )
    callback: CallbackIn | None = Field(
        default=None, description="POST the job's events to this URL as they happen (webhooks); see the README."
    )

    @field_validator("name")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            return check_name(value)
        except RequestError as exc:
            raise ValueError(exc.message) from None

    @field_validator("keep_alive", mode="before")
    @classmethod
    def _keep_alive(cls, value: object) -> float | None:
        if value is None:
            return None
        try:
            return parse_keep_alive(value)
        except RequestError as exc:
            raise ValueError(exc.message) from None

    def spec(self) -> LoadSpec:
        """The load as the job manager takes it.

        Raises:
            RequestError: invalid load options.
        """
        options = LoadOptions(
            staging_buffers=self.staging_buffers,
            staging_nbytes=self.staging_size,
            check_tensors=self.check_tensors,
            hash_tensors=self.hash_tensors,
        )
        keep_alive = None if self.keep_alive is None else float(self.keep_alive)
        callback = None if self.callback is None else self.callback.spec()
        return LoadSpec(self.model, self.name, self.flags(), options, keep_alive, callback)


class BufferOut(BaseModel):
    buffer_type: str
    device: str
    bytes: int
    mib: float
    mapped: bool
    host: bool


class MemoryReportOut(BaseModel):
    """Model buffers, one per line of llama.cpp's ``model buffer size`` report."""

    buffers: list[BufferOut]
    by_device: dict[str, dict[str, int]] = Field(description="Bytes per device, then per buffer type.")
    total_bytes: int
    lines: list[str] = Field(description="llama.cpp's report lines.")


class MemorySummaryOut(BaseModel):
    """Bytes per device and buffer type, and in all."""

    by_device: dict[str, dict[str, int]]
    total_bytes: int
    n_buffers: int


class CallbackStatusOut(BaseModel):
    """What a load's callback did so far."""

    target: str = Field(description="scheme://host:port of the callback URL.")
    delivered: int = Field(description="Events the receiver accepted (2xx).")
    retried: int = Field(description="Attempts repeated after a connection error, time-out or 5xx.")
    dropped: int = Field(description="Events given up on (failed, or too many waiting).")
    coalesced: int = Field(description="Progress events replaced by newer progress while the receiver was behind.")
    pending: int = Field(description="Events waiting for delivery.")
    last_error: str | None = Field(description="Why the latest failed attempt failed.")
    last_status: int | None = Field(description="HTTP status of the latest answer.")
    done: bool = Field(description="The sender ended (final event delivered or given up on).")


class LoadJobListed(BaseModel):
    """A load job as ``GET /v1/loads`` lists it: without its memory report."""

    id: str
    object: Literal["load_job"] = "load_job"
    model: str
    load_mode: str
    state: Literal["queued", "running", "succeeded", "failed", "cancelled"]
    cancel_requested: bool
    progress: float = Field(description="bytes_done / bytes_total, 0..1.")
    bytes_done: int
    bytes_total: int
    n_tensors: int
    plan: dict[str, Any] = Field(
        description="A summary (load mode in effect, layers, devices, fits, llama.cpp's lines); the whole plan is "
        "at /v1/loads/{id}/plan."
    )
    warnings: list[str] = Field(default_factory=list, description="mlock limits, direct I/O fallbacks, ...")
    stats: dict[str, Any] | None = Field(
        default=None,
        description="How the bytes moved, once succeeded: bytes per branch, staging pools, bytes_from_cache and "
        "bytes_from_disk, reads_in_flight, busy time and throughput per stage (touch, read, upload, validate) and "
        "the bound (the stage busy longest).",
    )
    error: dict[str, Any] | None = None
    memory_summary: MemorySummaryOut | None = Field(
        default=None, description="Once succeeded (kept once the model is unloaded)."
    )
    model_id: str | None = Field(
        default=None,
        description="The id of the model it loaded or shared, once succeeded (kept once the model is unloaded).",
    )
    name: str = Field(description="The name the model is hosted under.")
    shared: bool = Field(description="True when the load shared a resident model instead of loading a copy.")
    keep_alive: float = Field(description="Seconds the model stays after this load (negative: until unloaded).")
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    links: dict[str, str]
    callback: CallbackStatusOut | None = Field(default=None, description="Delivery status of the load's callback.")


class LoadJobOut(LoadJobListed):
    """A load job (``GET /v1/loads/{id}``)."""

    memory: MemoryReportOut | None = Field(
        default=None, description="The memory report, once succeeded, while the model is resident (null after)."
    )


class LoadJobList(BaseModel):
    data: list[LoadJobListed]
    total: int = Field(description="Jobs in all (listed or not).")


class DeviceModelUse(BaseModel):
    model_id: str
    name: str
    model: str
    buffer_types: dict[str, int] = Field(description="Bytes this model holds here, per buffer type.")
    total_bytes: int


class DeviceOut(BaseModel):
    name: str
    description: str
    type: str
    backend: str
    id: str | None
    free_bytes: int
    total_bytes: int
    max_alloc_bytes: int | None
    caps: dict[str, bool]
    buffer_types: list[str]
    models: list[DeviceModelUse]
    used_by_models_bytes: int
    reserved_bytes: int = Field(
        description="Bytes reserved here by queued and running loads and resident models (host memory: staging too)."
    )


class DeviceList(BaseModel):
    data: list[DeviceOut]


class ModelListed(BaseModel):
    """A resident model as ``GET /v1/models`` lists it: without its memory report."""

    id: str = Field(description="The id of the load job that loaded it.")
    object: Literal["model"] = "model"
    name: str
    model: str = Field(description="The model path, relative to the models directory.")
    state: Literal["resident", "unloaded"] = Field(
        description="'unloaded' only in the answer to the DELETE that freed it."
    )
    references: int = Field(description="Loads holding it; each DELETE drops one, the last frees it.")
    keep_alive: float = Field(description="Seconds it stays after its last load (negative: until unloaded).")
    expires_at: datetime | None = Field(description="When its keep-alive runs out (null: never).")
    last_used_at: datetime = Field(description="When a load last referenced it (eviction takes the oldest first).")
    load_mode: str
    n_tensors: int
    loaded_at: datetime
    memory_summary: MemorySummaryOut


class ModelOut(ModelListed):
    """A resident model (``GET /v1/models/{id}``)."""

    memory: MemoryReportOut = Field(description="The whole report.")


class TensorHashOut(BaseModel):
    name: str = Field(description="The tensor name.")
    xxh3_64: str = Field(description="xxh3_64 of its bytes as the file holds them: 16 hex digits.")


class TensorHashList(BaseModel):
    """``GET /v1/models/{name}/hashes``: the digests computed while the model loaded."""

    name: str
    id: str
    algorithm: Literal["xxh3_64"] = "xxh3_64"
    data: list[TensorHashOut] = Field(description="Tensors in load order, a page of them.")
    total: int = Field(description="Tensors hashed in all (listed or not).")


class ModelList(BaseModel):
    data: list[ModelListed]
    total: int = Field(description="Resident models in all (listed or not).")


class ModelReady(BaseModel):
    """``/v1/models/{name}/ready``."""

    name: str
    id: str
    ready: Literal[True] = True


class FileError(BaseModel):
    code: str
    message: str


class FileListed(BaseModel):
    """A GGUF file of the models directory (a split model once, by its first split)."""

    path: str = Field(description="Relative to the models directory: what a load's 'model' takes.")
    architecture: str | None = Field(description="general.architecture")
    file_type: int | None = Field(description="general.file_type")
    file_type_name: str | None = Field(description="Its name, as llama.cpp prints it (guessed when absent).")
    size_bytes: int | None = Field(description="File bytes, all splits together.")
    n_params: int | None = Field(description="Elements of all tensors.")
    n_tensors: int | None
    n_splits: int | None
    error: FileError | None = Field(description="Why the file could not be read as a model (then the rest is null).")


class FileList(BaseModel):
    data: list[FileListed]
    total: int = Field(description="Files in all (listed or not).")
    truncated: bool = Field(description="The walk of the directory stopped at its depth or entry limit.")
