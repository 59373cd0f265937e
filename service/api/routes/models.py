"""``/v1/models``: models resident in memory by name, their readiness, and unloading
them."""

from __future__ import annotations

import itertools
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from starlette.convertors import StringConvertor, register_url_convertor

from service.api.deps import JobsDep
from service.api.errors import problem
from service.api.routes.views import model_out
from service.api.schemas import COMMON_PROBLEMS, ModelList, ModelOut, ModelReady, TensorHashList, problem_responses
from service.errors import NotFoundError

router = APIRouter(prefix="/v1/models", tags=["models"], responses=COMMON_PROBLEMS)


class ModelRef(StringConvertor):
    """A model reference in a path: a name may hold slashes, and never ends in
    ``/ready`` or ``/hashes`` (those paths are the model's readiness and its tensor
    hashes, answered for ``GET`` only)."""

    regex = r"(?!.*/(?:ready|hashes)$).+"


register_url_convertor("model_ref", ModelRef())


@router.get("", response_model=ModelList, responses=problem_responses(422))
async def list_models(
    jobs: JobsDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=1_000_000)] = 0,
) -> JSONResponse:
    """Loaded models, oldest first, ``limit`` of them from ``offset`` (``total``: how many
    there are); each with its name, references, keep-alive and a summary of its memory
    (``GET /v1/models/{name}`` has the whole report)."""
    listed = itertools.islice(jobs.models.values(), offset, offset + limit)
    return JSONResponse({"data": [model_out(m, full=False) for m in listed], "total": len(jobs.models)})


@router.get("/{ref:path}/ready", response_model=ModelReady, responses=problem_responses(404))
async def model_ready(ref: str, jobs: JobsDep, request: Request) -> JSONResponse:
    """200 when the model (by name, id, or the id of a load that referenced it) is
    resident, as Triton's per-model readiness; 503 (``not_ready``) while a load of that
    name is queued or running, or it is a preloaded model not resident; 404 otherwise."""
    try:
        resident = jobs.get_model(ref)
    except NotFoundError:
        job = jobs.loading(ref)
        preloaded = any(p.name == ref for p in jobs.preloads)
        if job is None and not preloaded:
            raise
        detail = (
            f"model '{ref}' is being loaded (job {job.id}, {job.state.value})"
            if job is not None
            else f"the preloaded model '{ref}' is not resident"
        )
        extra = {"job_id": job.id} if job is not None else {}
        return problem(503, detail, "not_ready", request.url.path, {"Retry-After": "1"}, **extra)
    return JSONResponse({"name": resident.name, "id": resident.id, "ready": True})


@router.get("/{ref:path}/hashes", response_model=TensorHashList, responses=problem_responses(404, 422))
async def model_hashes(
    ref: str,
    jobs: JobsDep,
    limit: Annotated[int, Query(ge=1, le=10000)] = 1000,
    offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
) -> JSONResponse:
    """The xxh3_64 digest of every tensor's bytes, computed while the model loaded
    (``hash_tensors``), in load order, ``limit`` of them from ``offset`` (``total``: how
    many there are); 404 for a model loaded without ``hash_tensors``."""
    resident = jobs.get_model(ref)
    if not resident.hashed:
        raise NotFoundError(
            f"model '{resident.name}' was loaded without hash_tensors: it has no tensor hashes",
            hint="unload it and load it again with hash_tensors",
        )
    hashes = resident.loaded.tensor_hashes
    listed = itertools.islice(hashes.items(), offset, offset + limit)
    return JSONResponse(
        {
            "name": resident.name,
            "id": resident.id,
            "algorithm": "xxh3_64",
            "data": [{"name": name, "xxh3_64": digest} for name, digest in listed],
            "total": len(hashes),
        }
    )


@router.get("/{ref:model_ref}", response_model=ModelOut, responses=problem_responses(404))
async def get_model(ref: str, jobs: JobsDep) -> JSONResponse:
    """One loaded model, by name, id, or the id of a load that referenced it."""
    return JSONResponse(model_out(jobs.get_model(ref)))


@router.delete("/{ref:model_ref}", response_model=ModelOut, responses=problem_responses(404))
async def unload_model(ref: str, jobs: JobsDep) -> JSONResponse:
    """Drop one reference of a model (by name, id, or the id of a load that referenced
    it); the last one unloads it: its buffers and mappings are released (off the event
    loop) and it answers with ``state: unloaded``. Until then it stays resident and
    answers with the references left."""
    resident, freed = await jobs.unload(ref)
    return JSONResponse(model_out(resident, freed=freed))
