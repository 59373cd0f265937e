"""``HEAD`` answered wherever ``GET`` is (RFC 9110, 9.3.2): the same status and headers,
``Content-Length`` included, without the body."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class HeadAsGet:
    """Passes a ``HEAD`` request on as ``GET`` and drops the body of its response, so that
    every ``GET`` route answers ``HEAD`` too (FastAPI routes take only the methods they
    are declared with). The server sees the request as ``HEAD`` all the same.

    Args:
        app: the application.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def bodiless(message: Message) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                message = {**message, "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, bodiless)
