"""``/v1/models``: models resident in memory, and unloading them."""

from __future__ import annotations

import itertools
from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse

from service.api.deps import JobsDep
from service.api.routes.views import model_out
from service.api.schemas import COMMON_PROBLEMS, ModelList, ModelOut, problem_responses

router = APIRouter(prefix="/v1/models", tags=["models"], responses=COMMON_PROBLEMS)


@router.get("", response_model=ModelList, responses=problem_responses(422))
async def list_models(
    jobs: JobsDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=1_000_000)] = 0,
) -> JSONResponse:
    """Loaded models, oldest first, ``limit`` of them from ``offset`` (``total``: how many
    there are); each with a summary of its memory (``GET /v1/models/{id}`` has the whole
    report)."""
    listed = itertools.islice(jobs.models.values(), offset, offset + limit)
    return JSONResponse({"data": [model_out(m, full=False) for m in listed], "total": len(jobs.models)})


@router.get("/{model_id}", response_model=ModelOut, responses=problem_responses(404))
async def get_model(model_id: str, jobs: JobsDep) -> JSONResponse:
    """One loaded model."""
    return JSONResponse(model_out(jobs.get_model(model_id)))


@router.delete("/{model_id}", response_model=ModelOut, responses=problem_responses(404))
async def unload_model(model_id: str, jobs: JobsDep) -> JSONResponse:
    """Unload a model: its buffers and mappings are released."""
    return JSONResponse(model_out(jobs.unload(model_id)))
