"""``/v1/plans``: dry-run placement, as llama.cpp would decide it; nothing is allocated."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from service.api.deps import JobsDep
from service.api.schemas import PlanRequest

router = APIRouter(prefix="/v1/plans", tags=["plans"])


@router.post("")
async def make_plan(body: PlanRequest, jobs: JobsDep) -> dict[str, Any]:
    """Plan the placement of a model with llama.cpp's flags: the devices, the device of
    every layer, the buffer type of every tensor, the model buffers with their sizes,
    llama.cpp's offload and buffer lines, and whether each device's free memory holds
    its share (``fits``)."""
    _, _, placement = await jobs.plan_model(body.model, body.flags())
    data = placement.to_dict()
    data["model"] = body.model
    return data
