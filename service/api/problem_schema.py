"""The ``application/problem+json`` body (RFC 9457) as the OpenAPI document gives it: the
:class:`Problem` model and the responses every route documents with it (the errors
themselves are made in :mod:`~service.api.errors`)."""

from __future__ import annotations

import functools
import json
from typing import Any

from pydantic import BaseModel, ConfigDict


class Problem(BaseModel):
    """An error (RFC 9457 ``application/problem+json``); ``code`` is stable, and the file,
    key, tensor and byte offset are given where they apply."""

    model_config = ConfigDict(extra="allow")

    type: str
    title: str
    status: int
    detail: str
    code: str
    instance: str
    path: str | None = None
    offset: int | None = None
    key: str | None = None
    tensor: str | None = None
    hint: str | None = None


@functools.cache
def _problem_schema_json() -> str:
    return json.dumps(Problem.model_json_schema())


def _problem_schema() -> dict[str, Any]:
    """:class:`Problem`'s JSON schema, generated once (every route names it), a fresh copy
    each time."""
    schema: dict[str, Any] = json.loads(_problem_schema_json())
    return schema


def problem_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI responses: each status answered with a :class:`Problem`."""
    schema = _problem_schema()
    described = {
        400: "Invalid flags or path.",
        401: "A bearer token is required (when the service has one).",
        404: "No such job, model or model file.",
        408: "The request was not received in time.",
        409: "Conflicts with the state of the target, or does not fit the devices' memory.",
        410: "No longer kept (the plan of an ended load job whose model is not resident).",
        413: "The request body is too large.",
        422: "Invalid request body, or a file that is not valid GGUF or cannot be loaded.",
        429: "Too many loads queued or requests waiting (see Retry-After).",
        431: "The request line and headers are too large.",
        500: "Internal error.",
        503: "Too many connections are open (see Retry-After), or not ready.",
        507: "The server ran out of memory.",
    }
    return {
        status: {"description": described[status], "content": {"application/problem+json": {"schema": schema}}}
        for status in statuses
    }


COMMON_PROBLEMS = problem_responses(401, 408, 413, 431, 500, 503, 507)
