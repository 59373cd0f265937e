"""``/metrics``: Prometheus metrics in the text exposition format."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

from service.api.deps import JobsDep
from service.api.metrics import Metrics
from service.api.schemas import COMMON_PROBLEMS, problem_responses

router = APIRouter(tags=["metrics"], responses=COMMON_PROBLEMS)


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {
            "description": "The metrics, in the Prometheus text exposition format.",
            "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}},
        },
        **problem_responses(429),
    },
)
async def metrics(request: Request, jobs: JobsDep) -> Response:
    """Loads by mode and outcome, bytes loaded, load durations, loads running and
    queued, resident models and their bytes per device and buffer type, device memory,
    and requests by route; ``429`` when collecting takes longer than 5 s."""
    exporter: Metrics = request.state.metrics
    return Response(await exporter.exposition(jobs), media_type=CONTENT_TYPE_LATEST)
