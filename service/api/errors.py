"""Errors as ``application/problem+json`` (RFC 9457): each error class maps to one HTTP
status here, and nowhere else."""

from __future__ import annotations

import logging
import os
import sys
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import (
    AuthError,
    BudgetExceededError,
    BusyError,
    ByteOrderError,
    ConflictError,
    DeviceError,
    FormatError,
    GoneError,
    HoistError,
    LoadCancelledError,
    NotFoundError,
    PlacementError,
    RequestError,
    SplitError,
    StorageError,
    WorkLimitError,
    clip,
)

logger = logging.getLogger(__name__)

PROBLEM_JSON = "application/problem+json"

_STATUS: list[tuple[type[HoistError], int]] = [
    (AuthError, 401),
    (BusyError, 429),
    (WorkLimitError, 422),
    (BudgetExceededError, 409),
    (PlacementError, 400),
    (DeviceError, 507),
    (GoneError, 410),
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


def scrub_paths(value: Any, models_dir: str) -> Any:
    """``value`` (JSON-ready data) with every string's models directory prefix removed,
    so that responses name files relative to it and never reveal where the server keeps
    them; strings become valid UTF-8 (file names need not be)."""
    prefixes = {os.path.join(models_dir, ""), os.path.join(os.path.realpath(models_dir), "")}
    prefixes.discard("/")

    def scrub(v: Any) -> Any:
        if isinstance(v, str):
            for prefix in prefixes:
                v = v.replace(prefix, "")
            return v.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        if isinstance(v, dict):
            return {scrub(k): scrub(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [scrub(x) for x in v]
        return v

    return scrub(value)


def public_error(exc: HoistError, models_dir: str) -> dict[str, Any]:
    """``exc.to_dict()`` with paths shown relative to the models directory."""
    data: dict[str, Any] = scrub_paths(exc.to_dict(), models_dir)
    return data


def problem(
    status: int, detail: str, code: str, instance: str, headers: dict[str, str] | None = None, **extra: Any
) -> JSONResponse:
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
    return JSONResponse(body, status_code=status, media_type=PROBLEM_JSON, headers=headers)


async def _hoist_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HoistError)
    jobs = getattr(request.state, "jobs", None)
    data = public_error(exc, jobs.models_dir) if jobs is not None else exc.to_dict()
    detail = data.pop("message")
    code = data.pop("code")
    headers = None
    if isinstance(exc, BusyError):
        headers = {"Retry-After": str(exc.retry_after)}
    elif isinstance(exc, AuthError):
        headers = {"WWW-Authenticate": 'Bearer realm="hoist"'}
    return problem(status_for(exc), detail, code, request.url.path, headers, **data)


_HTTP_CODES = {413: "content_too_large", 422: "unprocessable_content"}
"""Codes of statuses whose phrase differs between Python versions (RFC 9110 names)."""


def unparsable_body(exc: BaseException) -> str | None:
    """Why a request body could not be parsed as JSON, from the exception Python's
    ``json.loads`` raised (FastAPI answers these with a bare 400 of its own, keeping the
    cause); None for an exception that does not say the body is malformed.

    The standard parser bounds nesting by the interpreter's recursion limit (a
    ``RecursionError`` long before the stack runs out) and integers by
    ``sys.get_int_max_str_digits()`` digits (a ``ValueError``).
    """
    if isinstance(exc, UnicodeDecodeError):
        return f"the body is not valid {exc.encoding.upper()} (at byte {exc.start}: {exc.reason})"
    if isinstance(exc, RecursionError):
        return "the body's JSON is nested too deep to parse"
    if isinstance(exc, ValueError) and "digits" in str(exc):
        return f"the body holds an integer of more than {sys.get_int_max_str_digits()} digits"
    if isinstance(exc, ValueError):
        return f"the body is not valid JSON ({clip(str(exc), 200)})"
    return None


def _unparsable_body(request: Request, why: str) -> JSONResponse:
    errors = [{"loc": ["body"], "msg": why, "type": "json_invalid"}]
    return problem(422, why, "validation_error", request.url.path, errors=errors)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    why = unparsable_body(exc.__cause__) if exc.status_code == 400 and exc.__cause__ is not None else None
    if why is not None:
        return _unparsable_body(request, why)
    code = _HTTP_CODES.get(exc.status_code) or HTTPStatus(exc.status_code).phrase.lower().replace(" ", "_")
    headers = dict(exc.headers or {})
    if exc.status_code == 405:
        headers["Allow"] = ", ".join(_allowed_methods(request))
    return problem(exc.status_code, str(exc.detail), code, request.url.path, headers or None)


_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at the request's path (Starlette's own answer names
    only the methods of the first route whose path matches): each method is tried
    against every route; ``HEAD`` is served wherever ``GET`` is (:mod:`.head`)."""
    allowed = []
    for method in _METHODS:
        scope = {"type": "http", "path": request.url.path, "method": method, "root_path": "", "headers": []}
        if any(route.matches(scope)[0] is Match.FULL for route in request.app.router.routes):
            allowed.append(method)
    if "GET" in allowed and "HEAD" not in allowed:
        allowed.insert(allowed.index("GET") + 1, "HEAD")
    return allowed


async def _memory_error(request: Request, exc: Exception) -> JSONResponse:
    logger.error("out of memory answering %s %s", request.method, request.url.path)
    return problem(507, "the server ran out of memory answering this request", "out_of_memory", request.url.path)


class UnhandledErrors:
    """Answers any exception the app lets through with a ``500`` problem+json (logged with
    its traceback; the client learns nothing internal), and keeps the connection usable.

    Args:
        app: the application.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception:
            logger.exception("internal error answering %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise
            response = problem(500, "internal server error", "internal_error", scope["path"])
            await response(scope, receive, send)


_MAX_ERRORS = 20
"""Validation errors listed in one response."""


def _message(error: dict[str, Any]) -> str:
    """A validation error's message, with the parser's reason for a body that is not
    JSON (``JSON decode error`` alone does not say what is wrong)."""
    reason = (error.get("ctx") or {}).get("error")
    if error["type"] == "json_invalid" and isinstance(reason, str):
        return f"{error['msg']}: {clip(reason, 200)}"
    return str(error["msg"])


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = [
        {"loc": [clip(x, 100) if isinstance(x, str) else x for x in e["loc"]], "msg": _message(e), "type": e["type"]}
        for e in exc.errors()[:_MAX_ERRORS]
    ]
    detail = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors)
    return problem(422, detail or "invalid request", "validation_error", request.url.path, errors=errors)


def install(app: FastAPI) -> None:
    """Register the problem+json handlers on ``app`` (and :class:`UnhandledErrors`, which
    the app adds as its outermost middleware)."""
    app.add_exception_handler(HoistError, _hoist_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(MemoryError, _memory_error)
