"""``/v1/plans``: dry-run placement, as llama.cpp would decide it; nothing is allocated."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from service.api.deps import ClientGoneDep, JobsDep
from service.api.schemas import COMMON_PROBLEMS, PlanRequest, problem_responses

router = APIRouter(prefix="/v1/plans", tags=["plans"], responses=COMMON_PROBLEMS)


@router.post("", responses=problem_responses(400, 404, 422, 429))
async def make_plan(body: PlanRequest, jobs: JobsDep, gone: ClientGoneDep, tensors: bool = True) -> Response:
    """Plan the placement of a model with llama.cpp's flags: the devices, the device of
    every layer, the buffer type of every tensor (``?tensors=false`` leaves them out), the
    model buffers with their sizes, llama.cpp's offload and buffer lines, and whether
    each device's free memory holds its share (``fits``). The work stops when the client
    goes away."""
    content = await jobs.plan_json(body.model, body.flags(), tensors=tensors, watch=gone)
    return Response(content, media_type="application/json")
