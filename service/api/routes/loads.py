"""``/v1/loads``: start, follow and cancel load jobs."""

from __future__ import annotations

from fastapi import APIRouter, Response

from service.api.deps import JobsDep
from service.api.routes.views import job_out
from service.api.schemas import LoadJobList, LoadJobOut, LoadRequest
from service.loader.pipeline import LoadOptions

router = APIRouter(prefix="/v1/loads", tags=["loads"])


@router.post("", status_code=202, response_model=LoadJobOut)
async def start_load(body: LoadRequest, jobs: JobsDep, response: Response) -> LoadJobOut:
    """Start loading a model in the background; answers at once with the job.

    The file's header is read and the placement planned before answering, so a missing
    or invalid file, invalid flags or a model that does not fit are a 4xx here rather
    than a failed job."""
    options = LoadOptions(
        staging_buffers=body.staging_buffers, staging_nbytes=body.staging_size, check_tensors=body.check_tensors
    )
    job = await jobs.submit(body.model, body.flags(), options)
    response.headers["Location"] = f"/v1/loads/{job.id}"
    return job_out(job)


@router.get("", response_model=LoadJobList)
async def list_loads(jobs: JobsDep) -> LoadJobList:
    """Every load job, oldest first."""
    return LoadJobList(data=[job_out(j) for j in jobs.jobs.values()])


@router.get("/{job_id}", response_model=LoadJobOut)
async def get_load(job_id: str, jobs: JobsDep) -> LoadJobOut:
    """One load job: state, bytes done / total, error, and the memory report once done."""
    return job_out(jobs.get(job_id))


@router.post("/{job_id}/cancel", status_code=202, response_model=LoadJobOut)
async def cancel_load(job_id: str, jobs: JobsDep) -> LoadJobOut:
    """Cancel a queued or running load; it ends ``cancelled`` once everything it took
    is released. 409 for a job that already ended."""
    return job_out(jobs.cancel(job_id))
