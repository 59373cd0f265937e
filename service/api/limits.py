"""Bounding what one request can make the service read: the body size, as a pure ASGI
middleware (bodies are refused by their ``Content-Length`` before they are read, and
counted as they arrive when they are sent in chunks)."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.errors import problem


class BodyLimit:
    """Answers ``413`` (problem+json) to a request whose body is larger than
    ``max_bytes``.

    Args:
        app: the application.
        max_bytes: the largest body, in bytes.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> str:
        return f"the request body is larger than {self.max_bytes} bytes"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                if not value.isdigit() or int(value) > self.max_bytes:
                    response = problem(413, self._too_large(), "content_too_large", scope["path"])
                    await response(scope, receive, send)
                    return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    # raised inside the app's body reading; answered as a problem there
                    raise HTTPException(413, self._too_large())
            return message

        await self.app(scope, counted, send)
