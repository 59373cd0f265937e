"""``/v1/plans``: dry-run placement, as llama.cpp would decide it; nothing is allocated."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from service.api.deps import ClientGoneDep, JobsDep
from service.api.routes.views import plan_out
from service.api.schemas import COMMON_PROBLEMS, PlanRequest, problem_responses

router = APIRouter(prefix="/v1/plans", tags=["plans"], responses=COMMON_PROBLEMS)


@router.post("", responses=problem_responses(400, 404, 422, 429))
async def make_plan(body: PlanRequest, jobs: JobsDep, gone: ClientGoneDep) -> JSONResponse:
    """Plan the placement of a model with llama.cpp's flags: the devices, the device of
    every layer, the buffer type of every tensor, the model buffers with their sizes,
    llama.cpp's offload and buffer lines, and whether each device's free memory holds
    its share (``fits``). The work stops when the client goes away."""
    _, _, placement = await jobs.plan_model(body.model, body.flags(), watch=gone)
    return JSONResponse(plan_out(placement, body.model, jobs.models_dir))
