"""The events of a load job, as one JSON shape everywhere they are sent (websocket,
server-sent events, the in-process iterator); pydantic models for the OpenAPI schema and
for clients that parse them.

Every event carries the job's progress as it stands when the event is made: ``seq`` is
the job's event counter (``snapshot`` and ``heartbeat`` carry the number of the latest
event they include and do not advance it), ``time`` when the event was made (UTC),
bytes done and total, the average throughput since the load started, the time left at
that rate, and the bytes in place per device so far.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel

EventKind = Literal["snapshot", "progress", "state", "warning", "report", "error", "heartbeat"]
EVENT_KINDS: tuple[str, ...] = ("snapshot", "progress", "state", "warning", "report", "error", "heartbeat")

JobStateName = Literal["queued", "running", "succeeded", "failed", "cancelled"]


class EventBase(BaseModel):
    """What every event carries."""

    model_config = ConfigDict(extra="allow")

    job_id: str = Field(description="The load job (``lj_...``).")
    seq: int = Field(ge=0, description="The job's event number; 0 before its first event.")
    time: datetime = Field(description="When the event was made (UTC).")
    state: JobStateName
    bytes_done: int = Field(ge=0, description="Tensor bytes in place so far (never decreases).")
    bytes_total: int = Field(ge=0, description="Tensor bytes the load brings in.")
    progress: float = Field(ge=0, le=1, description="bytes_done / bytes_total.")
    throughput_bps: float | None = Field(description="Bytes per second since the load started; null before.")
    eta_s: float | None = Field(description="Seconds left at that throughput; 0 once ended, null when unknown.")
    by_device: dict[str, int] = Field(description="Bytes in place so far per device.")
    final: bool = Field(description="The last event of the job: the stream closes after it.")


class ErrorOut(BaseModel):
    """Why a load failed (the job's ``error``)."""

    model_config = ConfigDict(extra="allow")

    code: str
    message: str


class ReportOut(BaseModel):
    """What a successful load reports."""

    model_config = ConfigDict(extra="allow")

    model_id: str = Field(description="The resident model (``/v1/models/{id}``).")
    load_time_s: float | None = Field(description="Seconds from the start of the load to its end.")
    memory_summary: dict[str, Any] | None = Field(description="Bytes per device and buffer type, total, buffers.")
    memory: dict[str, Any] | None = Field(description="The memory report (as in ``GET /v1/loads/{id}``).")
    plan_lines: list[str] = Field(description="llama.cpp's offload lines of the plan.")
    stats: dict[str, Any] | None = Field(
        description="How the bytes came in (per branch, from the page cache and from disk, busy time per stage, the "
        "bounding stage)."
    )


class SnapshotEvent(EventBase):
    """The job as it is: first on every stream (and in place of a backlog a slow
    subscriber fell behind on)."""

    event: Literal["snapshot"] = "snapshot"
    model: str = Field(description="The model path as requested.")
    warnings: list[str]
    error: ErrorOut | None = None


class ProgressEvent(EventBase):
    """Bytes moved (at most about ten a second per job)."""

    event: Literal["progress"] = "progress"


class StateEvent(EventBase):
    """The job moved to ``state`` (``running``, ``succeeded``, ``failed``, ``cancelled``;
    final when cancelled)."""

    event: Literal["state"] = "state"


class WarningEvent(EventBase):
    """Something the load noticed and carried on with."""

    event: Literal["warning"] = "warning"
    warning: str


class ReportEvent(EventBase):
    """The load succeeded (final)."""

    event: Literal["report"] = "report"
    report: ReportOut


class ErrorEvent(EventBase):
    """The load failed (final)."""

    event: Literal["error"] = "error"
    error: ErrorOut


class HeartbeatEvent(EventBase):
    """Nothing happened for a while; the stream is alive."""

    event: Literal["heartbeat"] = "heartbeat"


AnyEvent = Annotated[
    SnapshotEvent | ProgressEvent | StateEvent | WarningEvent | ReportEvent | ErrorEvent | HeartbeatEvent,
    Field(discriminator="event"),
]


class LoadEvent(RootModel[AnyEvent]):
    """One event of a load job, told apart by ``event``."""
