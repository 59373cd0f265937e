"""``/v1/loads``: start, follow and cancel load jobs."""

from __future__ import annotations

import itertools
from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse, Response

from service.api.deps import ClientGoneDep, JobsDep
from service.api.routes.views import job_json, job_listed, job_out
from service.api.schemas import COMMON_PROBLEMS, LoadJobList, LoadJobOut, LoadRequest, problem_responses

router = APIRouter(prefix="/v1/loads", tags=["loads"], responses=COMMON_PROBLEMS)

_SUBMIT = problem_responses(400, 404, 409, 422, 429)
_ONE = problem_responses(404)


@router.post("", status_code=202, response_model=LoadJobOut, responses=_SUBMIT)
async def start_load(body: LoadRequest, jobs: JobsDep, gone: ClientGoneDep) -> JSONResponse:
    """Start loading a model in the background; answers at once with the job.

    The file's header is read and the placement planned before answering (once: the
    load runs that plan), so a missing or invalid file, invalid flags, a big-endian file
    or a model that does not fit beside the loads and models already admitted are a 4xx
    here rather than a failed job; beyond ``HOIST_MAX_QUEUED_LOADS`` waiting loads the
    answer is 429. A load of a model resident under the same name (or any name, when
    none is given) from the same files with the same resolved placement shares it: the
    job is ``succeeded`` at once with ``shared: true``; a name held by another model is
    409 (``name_taken``), by a load of the same model in progress 409
    (``load_in_progress``). A ``callback`` whose URL ``HOIST_CALLBACK_HOSTS`` does not
    allow (or any, when it is empty) is 400 (``callback_refused``); an accepted one gets
    the job's events POSTed as they happen, its delivery status in the job's
    ``callback``."""
    job = await jobs.submit(body.spec(), watch=gone)
    return JSONResponse(job_out(job, jobs.models_dir), status_code=202, headers={"Location": f"/v1/loads/{job.id}"})


@router.get("", response_model=LoadJobList, responses=problem_responses(422))
async def list_loads(
    jobs: JobsDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=1_000_000)] = 0,
) -> JSONResponse:
    """Load jobs, oldest first, ``limit`` of them from ``offset`` (``total``: how many
    there are); each without its memory report (``GET /v1/loads/{id}`` has it)."""
    listed = list(itertools.islice(jobs.jobs.values(), offset, offset + limit))
    return JSONResponse({"data": [job_listed(j, jobs.models_dir) for j in listed], "total": len(jobs.jobs)})


@router.get("/{job_id}", response_model=LoadJobOut, responses=_ONE)
async def get_load(job_id: str, jobs: JobsDep) -> Response:
    """One load job: state, bytes done / total, a summary of its plan, error, and the
    memory report once done."""
    return Response(job_json(jobs.get(job_id), jobs.models_dir), media_type="application/json")


@router.get("/{job_id}/plan", responses=problem_responses(404, 410, 422, 429))
async def get_load_plan(job_id: str, jobs: JobsDep, gone: ClientGoneDep, tensors: bool = True) -> Response:
    """The whole plan of a load job, every tensor's placement included unless
    ``?tensors=false`` (as ``POST /v1/plans`` gives it). Kept while the job is queued or
    running and while its model is resident; ``410`` after."""
    content = await jobs.job_plan_json(job_id, tensors=tensors, watch=gone)
    return Response(content, media_type="application/json")


@router.post("/{job_id}/cancel", status_code=202, response_model=LoadJobOut, responses=problem_responses(404, 409))
async def cancel_load(job_id: str, jobs: JobsDep) -> JSONResponse:
    """Cancel a queued or running load; it ends ``cancelled`` once everything it took
    is released. 409 for a job that already ended."""
    return JSONResponse(job_out(jobs.cancel(job_id), jobs.models_dir), status_code=202)
