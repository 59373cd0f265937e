"""Errors as ``application/problem+json`` (RFC 9457): each error class maps to one HTTP
status here, and nowhere else."""

from __future__ import annotations

import os
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.errors import (
    BudgetExceededError,
    ByteOrderError,
    ConflictError,
    DeviceError,
    FormatError,
    HoistError,
    LoadCancelledError,
    NotFoundError,
    PlacementError,
    RequestError,
    SplitError,
    StorageError,
)

PROBLEM_JSON = "application/problem+json"

_STATUS: list[tuple[type[HoistError], int]] = [
    (BudgetExceededError, 409),
    (PlacementError, 400),
    (DeviceError, 507),
    (NotFoundError, 404),
    (RequestError, 400),
    (ConflictError, 409),
    (LoadCancelledError, 409),
    (FormatError, 422),
    (SplitError, 422),
    (ByteOrderError, 422),
    (StorageError, 422),
]


def status_for(exc: HoistError) -> int:
    """The HTTP status of a hoist error (500 for classes not listed)."""
    for cls, status in _STATUS:
        if isinstance(exc, cls):
            return status
    return 500


def public_error(exc: HoistError, models_dir: str) -> dict[str, Any]:
    """``exc.to_dict()`` with paths shown relative to the models directory, so that
    responses do not reveal where the server keeps its files."""
    data = exc.to_dict()
    prefixes = {os.path.join(models_dir, ""), os.path.join(os.path.realpath(models_dir), "")}
    for key in ("message", "path", "hint", "key", "tensor"):
        value = data.get(key)
        if isinstance(value, str):
            for prefix in prefixes:
                value = value.replace(prefix, "")
            # file names need not be UTF-8; JSON must be
            data[key] = value.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    return data


def problem(status: int, detail: str, code: str, instance: str, **extra: Any) -> JSONResponse:
    """A problem+json response."""
    body: dict[str, Any] = {
        "type": f"urn:hoist:error:{code}",
        "title": HTTPStatus(status).phrase,
        "status": status,
        "detail": detail,
        "code": code,
        "instance": instance,
    }
    body.update(extra)
    return JSONResponse(body, status_code=status, media_type=PROBLEM_JSON)


async def _hoist_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HoistError)
    jobs = getattr(request.state, "jobs", None)
    data = public_error(exc, jobs.models_dir) if jobs is not None else exc.to_dict()
    detail = data.pop("message")
    code = data.pop("code")
    return problem(status_for(exc), detail, code, request.url.path, **data)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = HTTPStatus(exc.status_code).phrase.lower().replace(" ", "_")
    return problem(exc.status_code, str(exc.detail), code, request.url.path)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
    detail = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors)
    return problem(422, detail or "invalid request", "validation_error", request.url.path, errors=errors)


def install(app: FastAPI) -> None:
    """Register the problem+json handlers on ``app``."""
    app.add_exception_handler(HoistError, _hoist_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
