"""``/v1/files``: the model repository, the GGUF files a load can name."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse

from service.api.deps import ClientGoneDep, JobsDep
from service.api.schemas import COMMON_PROBLEMS, FileList, problem_responses

router = APIRouter(prefix="/v1/files", tags=["files"], responses=COMMON_PROBLEMS)


@router.get("", response_model=FileList, responses=problem_responses(422, 429))
async def list_files(
    jobs: JobsDep,
    gone: ClientGoneDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=1_000_000)] = 0,
) -> JSONResponse:
    """The ``.gguf`` files under the models directory, sorted by path, ``limit`` of them
    from ``offset`` (``total``: how many there are): a split model once, by its first
    split. Each has a summary of its header (architecture, file type, bytes of all
    splits, parameters, tensors, splits), or the error that keeps it from being read as
    a model. The walk and the header parsing run on the request threads, headers within
    the service's header limits, and summaries are cached by file identity."""
    return JSONResponse(await jobs.list_files(offset, limit, watch=gone))
