"""Service settings, from ``HOIST_*`` environment variables or the CLI."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.logs import LogFormat

if TYPE_CHECKING:
    from service.api.spec import LoadSpec

MAX_TOKEN_FILE_BYTES = 4096
"""Largest API token file read."""


class Settings(BaseSettings):
    """Settings of one service instance."""

    # the docstring under each field documents it (see :func:`field_docs`); pydantic's
    # use_attribute_docstrings would read this source at every start
    model_config = SettingsConfigDict(env_prefix="HOIST_", extra="ignore")

    models_dir: Path = Field(default=Path("models"))
    """Directory that request paths are relative to; requests cannot leave it
    (``HOIST_MODELS_DIR``)."""

    max_concurrent_loads: int = Field(default=1, ge=1, le=64)
    """Loads that run at once; further loads wait in state ``queued``
    (``HOIST_MAX_CONCURRENT_LOADS``)."""

    max_queued_loads: int = Field(default=8, ge=0, le=10_000)
    """Loads that may wait in state ``queued``; beyond, ``POST /v1/loads`` answers 429
    with ``Retry-After`` (``HOIST_MAX_QUEUED_LOADS``)."""

    max_resident_models: int = Field(default=64, ge=1, le=4096)
    """Models resident at once, counting the queued and running loads that will add one;
    beyond, ``POST /v1/loads`` answers 409 (``model_limit``) until a model is unloaded
    (``HOIST_MAX_RESIDENT_MODELS``)."""

    emulated_devices: str | None = Field(default=None, max_length=4096)
    """Emulated GPUs to offer, as ``EMU0=3000MiB,EMU1=1000MiB`` (``HOIST_EMULATED_DEVICES``)."""

    cuda: bool = Field(default=True)
    """Use CUDA GPUs through PyTorch when available (``HOIST_CUDA``)."""

    job_history: int = Field(default=256, ge=1, le=100_000)
    """Ended load jobs kept for listing (``HOIST_JOB_HISTORY``)."""

    api_token: SecretStr | None = Field(default=None)
    """Bearer token every request but ``/healthz`` and ``/readyz`` must carry
    (``HOIST_API_TOKEN``)."""

    api_token_file: Path | None = Field(default=None)
    """File holding the bearer token, e.g. a container secret (``HOIST_API_TOKEN_FILE``);
    surrounding white space is ignored."""

    allow_unauthenticated: bool = Field(default=False)
    """Let ``hoist serve`` listen on a non-loopback address without a token
    (``HOIST_ALLOW_UNAUTHENTICATED``)."""

    request_workers: int = Field(default=4, ge=1, le=64)
    """Threads that read headers and plan placements for requests
    (``HOIST_REQUEST_WORKERS``)."""

    max_waiting_requests: int = Field(default=32, ge=0, le=10_000)
    """Requests that may wait for one of those threads; beyond, 429 with ``Retry-After``
    (``HOIST_MAX_WAITING_REQUESTS``)."""

    request_timeout_s: float = Field(default=30.0, gt=0, le=3600)
    """Time limit of one request's header reading and planning, in seconds
    (``HOIST_REQUEST_TIMEOUT_S``)."""

    override_budget_s: float = Field(default=1.0, gt=0, le=60)
    """Time the ``-ot`` patterns of one request may take to match every tensor name, in
    seconds (``HOIST_OVERRIDE_BUDGET_S``)."""

    max_body_bytes: int = Field(default=1 << 20, ge=1024, le=1 << 30)
    """Largest request body, in bytes; beyond, 413 (``HOIST_MAX_BODY_BYTES``)."""

    max_connections: int = Field(default=1024, ge=1, le=1_000_000)
    """Open connections at once; one more is answered 503 and closed
    (``HOIST_MAX_CONNECTIONS``)."""

    max_request_head_bytes: int = Field(default=64 << 10, ge=4096, le=16 << 20)
    """Largest request line and headers, in bytes; beyond, 431
    (``HOIST_MAX_REQUEST_HEAD_BYTES``)."""

    request_read_timeout_s: float = Field(default=10.0, gt=0, le=3600)
    """Time to receive a whole request once it begins (and the first one once a
    connection opens), in seconds; beyond, 408 and the connection is closed
    (``HOIST_REQUEST_READ_TIMEOUT_S``)."""

    send_timeout_s: float = Field(default=10.0, gt=0, le=3600)
    """Time a client may leave a response unread (the connection's send buffer full,
    nothing taken), in seconds; beyond, the connection is dropped and the response's
    memory freed (``HOIST_SEND_TIMEOUT_S``)."""

    max_gguf_header_bytes: int = Field(default=64 << 20, ge=1 << 20, le=1 << 40)
    """Largest GGUF header (metadata and tensor infos, all splits together) a request may
    make the service read, in bytes; beyond, 422 (``HOIST_MAX_GGUF_HEADER_BYTES``)."""

    max_tensors: int = Field(default=65536, ge=1, le=1 << 30)
    """Most tensors in a model (all splits together); beyond, 422 (``HOIST_MAX_TENSORS``)."""

    max_kv_pairs: int = Field(default=65536, ge=1, le=1 << 30)
    """Most KV pairs in a model (all splits together); beyond, 422 (``HOIST_MAX_KV_PAIRS``)."""

    max_splits: int = Field(default=256, ge=1, le=65535)
    """Most files of a split model (each is open while it loads); beyond, 422
    (``HOIST_MAX_SPLITS``)."""

    load_timeout_s: float = Field(default=0.0, ge=0, le=7 * 24 * 3600)
    """Time limit of one load, in seconds; a load still running then is stopped and fails
    with ``work_limit_exceeded``, releasing what it took (``HOIST_LOAD_TIMEOUT_S``; 0: no
    limit)."""

    host_buffer_cache_bytes: int = Field(default=4 << 30, ge=0, le=1 << 50)
    """Bytes of freed large host buffers kept, pages touched, for the next load of a
    model of the same buffer sizes (a reload fills them instead of faulting in fresh
    pages); counted as held by hoist and dropped after a minute without loads or unloads,
    when host memory runs low, or when a load needs the memory
    (``HOIST_HOST_BUFFER_CACHE_BYTES``; 0: none kept)."""

    file_check_interval_s: float = Field(default=2.0, ge=0, le=3600)
    """How often the files of resident models with mapped tensors are checked; a model
    whose file shrank or was rewritten is unloaded before anything reads its pages
    (``HOIST_FILE_CHECK_INTERVAL_S``; 0: never)."""

    log_format: LogFormat = Field(default=LogFormat.TEXT)
    """How ``hoist serve`` writes its log records, uvicorn's access log included:
    ``text`` lines or ``json`` lines (one object a record, with ``job_id`` and ``model``
    on a load's records) (``HOIST_LOG_FORMAT``)."""

    keep_alive: str = Field(default="-1", max_length=64)
    """How long a model stays resident after the last load that referenced it, when the
    load gives no ``keep_alive``: seconds, or a duration such as ``5m`` or ``1h30m``; 0
    unloads it once loaded, a negative value keeps it until unloaded. Forever by default:
    hoist serves no inference requests that would keep a model in use
    (``HOIST_KEEP_ALIVE``)."""

    evict_idle: bool = Field(default=False)
    """Unload resident models, least recently used first, when a new load would not fit
    beside them (instead of answering 409); the load's warnings name them
    (``HOIST_EVICT_IDLE``)."""

    preload: str | None = Field(default=None, max_length=1 << 20)
    """Models to load at start, as model paths relative to the models directory separated
    by commas, or a JSON list of load bodies (``[{"model": "x.gguf", "name": "x",
    "n_gpu_layers": 99}]``); ``/readyz`` answers 200 once all are resident
    (``HOIST_PRELOAD``)."""

    callback_hosts: str = Field(default="", max_length=16384)
    """Hosts that load callbacks (webhooks) may be sent to: host names, ``*.domain``
    wildcards and CIDR networks, separated by commas; empty: a load with a ``callback``
    is refused (400). Each delivery resolves the host and sends only to addresses inside
    a listed network, or to public addresses of a host listed by name
    (``HOIST_CALLBACK_HOSTS``)."""

    callback_secret: SecretStr | None = Field(default=None)
    """Key that signs every callback request: ``Hoist-Signature: t=<unix seconds>,v1=<hex
    HMAC-SHA256 of "<t>.<body>">`` (``HOIST_CALLBACK_SECRET``; unset: unsigned)."""

    callback_timeout_s: float = Field(default=5.0, gt=0, le=300)
    """Connect and read time limit of one callback request, in seconds
    (``HOIST_CALLBACK_TIMEOUT_S``)."""

    callback_retry_s: float = Field(default=60.0, ge=0, le=24 * 3600)
    """How long a load's final callback event (report, error, cancelled) is retried, in
    seconds; other events at most as long, progress is tried twice and other events five
    times at most (``HOIST_CALLBACK_RETRY_S``)."""

    @field_validator("callback_hosts")
    @classmethod
    def _callback_hosts_parse(cls, value: str) -> str:
        from service.api.callback_policy import AllowList

        AllowList(value)
        return value

    @field_validator("keep_alive")
    @classmethod
    def _keep_alive_parse(cls, value: str) -> str:
        from service.api.keepalive import parse_keep_alive
        from service.errors import HoistError

        try:
            parse_keep_alive(value)
        except HoistError as exc:
            raise ValueError(exc.message) from None
        return value

    @field_validator("preload")
    @classmethod
    def _preload_parse(cls, value: str | None) -> str | None:
        preload_specs(value)
        return value

    def keep_alive_s(self) -> float:
        """:attr:`keep_alive` in seconds (negative: forever)."""
        from service.api.keepalive import parse_keep_alive

        return parse_keep_alive(self.keep_alive)

    @field_validator("emulated_devices")
    @classmethod
    def _emulated_devices_parse(cls, value: str | None) -> str | None:
        from service.errors import HoistError
        from service.loader.devices import parse_emulated_devices

        try:
            parse_emulated_devices(value)
        except HoistError as exc:
            raise ValueError(exc.describe()) from None
        return value

    @field_validator("models_dir")
    @classmethod
    def _models_dir_exists(cls, value: Path) -> Path:
        if not value.is_dir():
            raise ValueError(f"models directory {value} does not exist or is not a directory")
        return value.resolve()

    @model_validator(mode="after")
    def _token_readable(self) -> Settings:
        self.token()
        return self

    def token(self) -> str | None:
        """The bearer token (from ``api_token``, else ``api_token_file``), or None.

        Raises:
            ValueError: both are set, the file cannot be read or is too long, or the token
                is empty or holds white space or control characters.
        """
        if self.api_token is not None and self.api_token_file is not None:
            raise ValueError("set HOIST_API_TOKEN or HOIST_API_TOKEN_FILE, not both")
        if self.api_token is not None:
            token = self.api_token.get_secret_value().strip()
        elif self.api_token_file is not None:
            try:
                with open(self.api_token_file, "rb") as f:
                    raw = f.read(MAX_TOKEN_FILE_BYTES + 1)
            except OSError as exc:
                raise ValueError(f"cannot read the API token file {self.api_token_file}: {exc.strerror}") from None
            if len(raw) > MAX_TOKEN_FILE_BYTES:
                raise ValueError(f"the API token file is longer than {MAX_TOKEN_FILE_BYTES} bytes")
            token = raw.decode("utf-8", "replace").strip()
        else:
            return None
        if not token or any(c.isspace() or not c.isprintable() or not c.isascii() for c in token):
            raise ValueError("the API token must be non-empty printable ASCII without white space")
        return token


def preload_specs(value: str | None) -> list[LoadSpec]:
    """The loads ``HOIST_PRELOAD`` asks for: a JSON list of load bodies (``[`` first), or
    model paths separated by commas.

    Raises:
        ValueError: not valid JSON, a body the load schema refuses, or an empty path.
    """
    if value is None or not value.strip():
        return []  # without importing the load schema, which a start without preloads does not need
    import json

    from pydantic import TypeAdapter, ValidationError

    from service.api.schemas import LoadRequest

    text = value.strip()
    try:
        if text.startswith("["):
            requests = TypeAdapter(list[LoadRequest]).validate_python(json.loads(text))
        else:
            paths = [p.strip() for p in text.split(",")]
            if not all(paths):
                raise ValueError("HOIST_PRELOAD has an empty model path (between commas)")
            requests = [LoadRequest(model=p) for p in paths]
    except json.JSONDecodeError as exc:
        raise ValueError(f"HOIST_PRELOAD is not valid JSON: {exc}") from None
    except ValidationError as exc:
        errors = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5])
        raise ValueError(f"HOIST_PRELOAD: {errors}") from None
    return [r.spec() for r in requests]


def field_docs() -> dict[str, str]:
    """Each :class:`Settings` field's docstring (the string literal under it), read from
    this module's source."""
    import ast
    import inspect

    docs: dict[str, str] = {}
    body = ast.parse(inspect.getsource(Settings)).body[0]
    assert isinstance(body, ast.ClassDef)
    for stmt, after in zip(body.body, body.body[1:], strict=False):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return docs


def markdown_table() -> list[str]:
    """The rows of the README's settings table: variable, default, what it does (the
    field's docstring without the variable name it ends with)."""
    rows = []
    docs = field_docs()
    for name, field in Settings.model_fields.items():
        env = f"HOIST_{name.upper()}"
        default = field.default
        shown = "unset" if default is None else str(default).lower() if isinstance(default, bool) else str(default)
        text = " ".join(docs.get(name, "").split())
        text = text.replace(f" (``{env}``)", "").replace(f" (``{env}``; ", " (")
        text = text.replace("``", "`")
        rows.append(f"| `{env}` | `{shown}` | {text} |")
    return rows
