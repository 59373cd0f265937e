"""``/healthz`` (liveness, independent of any model's state) and ``/readyz`` (readiness:
the preloaded models are resident)."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from service.api.deps import JobsDep
from service.api.errors import problem
from service.api.problem_schema import problem_responses

router = APIRouter(tags=["health"])


class Health(BaseModel):
    status: Literal["ok"] = "ok"


class Ready(BaseModel):
    """``/readyz``: every preloaded model is resident."""

    status: Literal["ready"] = "ready"
    models: list[str] = Field(description="The preloaded models' names.")


@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """200 while the event loop answers (``HEAD`` too, as on every ``GET`` route)."""
    return Health()


@router.get("/readyz", response_model=Ready, responses=problem_responses(503))
async def readyz(jobs: JobsDep, request: Request) -> JSONResponse:
    """200 once every model of ``HOIST_PRELOAD`` is resident (at once without any); else
    503 (``not_ready``) listing those ``pending`` (with their job) and ``failed`` (with
    the error). A preloaded model unloaded later makes it 503 again."""
    ready, pending, failed = jobs.readiness()
    if pending or failed:
        parts = []
        if pending:
            parts.append(f"{len(pending)} preloaded model{'s' if len(pending) > 1 else ''} not resident yet")
        if failed:
            parts.append(f"{len(failed)} failed to load")
        return problem(
            503, "; ".join(parts), "not_ready", request.url.path, {"Retry-After": "1"}, pending=pending, failed=failed
        )
    return JSONResponse({"status": "ready", "models": ready})
