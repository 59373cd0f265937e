"""``/v1/loads/{id}/events``: the live events of a load job, over a websocket or as
server-sent events (``Accept: text/event-stream``); the same JSON either way
(:mod:`service.api.event_schema`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Annotated

from fastapi import APIRouter, Header, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import Response

from service.api.deps import JobsDep
from service.api.errors import problem
from service.api.event_schema import LoadEvent
from service.api.events import EventHub
from service.api.jobs import JobManager, LoadJob
from service.api.schemas import COMMON_PROBLEMS, problem_responses
from service.errors import clip

if TYPE_CHECKING:
    from sse_starlette import ServerSentEvent

router = APIRouter(prefix="/v1/loads", tags=["loads"], responses=COMMON_PROBLEMS)

SSE_RETRY_MS = 2000
"""How long an EventSource client waits before it reconnects (it resumes from the last
event id)."""

MAX_EVENT_ID = 1 << 62
"""Largest ``Last-Event-ID`` taken; beyond it (or not a number) the stream starts anew."""


class EventStream(Response):
    """What ``/v1/loads/{id}/events`` answers, for the OpenAPI document (the stream itself
    is sse-starlette's ``EventSourceResponse``, imported with the first stream)."""

    media_type = "text/event-stream"


def _accepts_sse(accept: str | None) -> bool:
    if not accept:
        return True
    kinds = {part.split(";", 1)[0].strip().lower() for part in accept.split(",")}
    return bool(kinds & {"text/event-stream", "text/*", "*/*"})


def _event_id(value: str | None) -> int | None:
    if value is None:
        return None
    value = value.strip()
    if not value.isdecimal() or len(value) > 19 or int(value) > MAX_EVENT_ID:
        return None
    return int(value)


@router.get(
    "/{job_id}/events",
    response_model=LoadEvent,
    response_class=EventStream,
    responses={**problem_responses(404), 406: problem_responses(404)[404] | {"description": "No text/event-stream."}},
)
async def load_events(
    job_id: str,
    request: Request,
    jobs: JobsDep,
    accept: Annotated[str | None, Header()] = None,
    last_event_id: Annotated[str | None, Header()] = None,
) -> Response:
    """The events of a load job as server-sent events (``event:`` the kind, ``id:`` the
    sequence number, ``data:`` the event's JSON): a snapshot first, progress at most
    about ten times a second, every state change and warning, heartbeats, and the final
    report or error, after which the stream ends. ``Last-Event-ID`` resumes after that
    event (a snapshot when the events after it are no longer held); ``204`` once the
    final event was seen. The same events come over a websocket on this path."""
    job = jobs.get(job_id)
    if not _accepts_sse(accept):
        return problem(406, "this path sends text/event-stream (or a websocket)", "not_acceptable", request.url.path)
    after = _event_id(last_event_id)
    hub = jobs.events
    final = hub.final_seq(job)
    if after is not None and final is not None and after >= final and hub.channel(job).replayable(after):
        return Response(status_code=204)
    from sse_starlette import EventSourceResponse

    return EventSourceResponse(_sse(hub, job, after), ping=None, headers={"X-Accel-Buffering": "no"})


async def _sse(hub: EventHub, job: LoadJob, after: int | None) -> AsyncIterator[ServerSentEvent]:
    from sse_starlette import ServerSentEvent

    first = True
    async for event in hub.follow(job, after=after):
        yield ServerSentEvent(
            event.data,
            event=event.kind,
            id=None if event.kind == "heartbeat" else str(event.seq),
            retry=SSE_RETRY_MS if first else None,
        )
        first = False


@router.websocket("/{job_id}/events")
async def load_events_ws(websocket: WebSocket, job_id: str) -> None:
    """The events of a load job over a websocket, one JSON text message each, ending
    with the final event and a normal close (1000). ``?after=N`` resumes after event
    ``N`` as ``Last-Event-ID`` does. An unknown job is answered ``404`` before the
    handshake."""
    jobs: JobManager = websocket.state.jobs
    job = jobs.jobs.get(job_id)
    if job is None:
        response = problem(404, f"no load job '{clip(job_id, 100)}'", "not_found", websocket.url.path)
        if "websocket.http.response" in websocket.scope.get("extensions", {}):
            await websocket.send_denial_response(response)
        else:
            await websocket.close(code=4404, reason="no such load job")
        return
    after = _event_id(websocket.query_params.get("after"))
    await websocket.accept()
    sender = asyncio.create_task(_send_events(websocket, jobs.events, job, after))
    receiver = asyncio.create_task(_until_disconnect(websocket))
    try:
        await asyncio.wait({sender, receiver}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (sender, receiver):
            task.cancel()
        for task in (sender, receiver):
            with contextlib.suppress(asyncio.CancelledError, WebSocketDisconnect, RuntimeError, OSError):
                await task


async def _send_events(websocket: WebSocket, hub: EventHub, job: LoadJob, after: int | None) -> None:
    async for event in hub.follow(job, after=after):
        await websocket.send_text(event.data)
    await websocket.close(code=1000)


async def _until_disconnect(websocket: WebSocket) -> None:
    """Read (and ignore) what the client sends until it goes away."""
    while True:
        message = await websocket.receive()
        if message["type"] == "websocket.disconnect":
            return
