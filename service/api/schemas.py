"""Request and response bodies of the HTTP API (pydantic, at the boundary only)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class LoadRequest(BaseModel):
    """Body of ``POST /v1/loads``."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="Path of the GGUF file, relative to the models directory.")
    load_mode: Literal["mmap", "none"] = Field(
        default="mmap", description="How tensor data gets into memory (llama.cpp --load-mode)."
    )


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


class LoadJobOut(BaseModel):
    """A load job (``GET /v1/loads/{id}``)."""

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
    error: dict[str, Any] | None = None
    memory: MemoryReportOut | None = Field(default=None, description="Set once the job succeeded.")
    model_id: str | None = Field(default=None, description="The loaded model's id, once succeeded.")
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    links: dict[str, str]


class LoadJobList(BaseModel):
    data: list[LoadJobOut]


class DeviceModelUse(BaseModel):
    model_id: str
    model: str
    buffer_types: dict[str, int] = Field(description="Bytes this model holds here, per buffer type.")
    total_bytes: int


class DeviceOut(BaseModel):
    name: str
    description: str
    type: str
    free_bytes: int
    total_bytes: int
    models: list[DeviceModelUse]
    used_by_models_bytes: int


class DeviceList(BaseModel):
    data: list[DeviceOut]


class ModelOut(BaseModel):
    id: str
    object: Literal["model"] = "model"
    model: str
    load_mode: str
    n_tensors: int
    loaded_at: datetime
    memory: MemoryReportOut


class ModelList(BaseModel):
    data: list[ModelOut]


class Health(BaseModel):
    status: Literal["ok"] = "ok"
