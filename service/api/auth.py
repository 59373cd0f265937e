"""Bearer token authentication of every request but the health probes, as a pure ASGI
middleware (so that it covers every route, websockets and unknown paths alike)."""

from __future__ import annotations

import hashlib
import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from service.api.errors import problem

OPEN_PATHS = frozenset({"/healthz", "/readyz"})
"""Paths served without a token (liveness and readiness probes must not depend on a
secret; neither says more than which preloaded models are resident)."""


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


class BearerAuth:
    """Answers ``401`` (problem+json, ``WWW-Authenticate: Bearer``) to a request without
    ``Authorization: Bearer <token>``; the token is compared in constant time (as
    SHA-256 digests, so that its length does not show either).

    Args:
        app: the application.
        token: the token requests must carry.
    """

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self._digest = _digest(token.encode("ascii"))

    def _authorized(self, scope: Scope) -> tuple[bool, bool]:
        """(authorized, a token was given)."""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, credentials = value.strip().partition(b" ")
                if scheme.lower() != b"bearer":
                    return False, False
                return hmac.compare_digest(_digest(credentials.strip()), self._digest), True
        return False, False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        ok, given = self._authorized(scope)
        if ok:
            await self.app(scope, receive, send)
            return
        challenge = 'Bearer realm="hoist"' + (', error="invalid_token"' if given else "")
        detail = "the bearer token is not valid" if given else "this endpoint needs 'Authorization: Bearer <token>'"
        response = problem(401, detail, "unauthorized", scope["path"], {"WWW-Authenticate": challenge})
        if scope["type"] == "websocket" and "websocket.http.response" not in scope.get("extensions", {}):
            # a server that cannot answer a handshake with a response: policy violation
            await send({"type": "websocket.close", "code": 1008, "reason": "a bearer token is required"})
            return
        await response(scope, receive, send)  # a websocket handshake is refused with it too
