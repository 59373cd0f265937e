"""The HTTP server: uvicorn (httptools, uvloop) with what it lacks on an exposed port.

uvicorn's httptools protocol reads a request head of any size, waits for a request as
long as a client likes, and answers the requests it refuses itself (malformed, over the
connection limit) in plain text. :class:`GuardedHttpToolsProtocol` bounds the head (URL
and headers) and the time to receive a whole request, refuses connections beyond the
limit as they open, and answers all of these as problem+json.
"""

from __future__ import annotations

import asyncio
import json
from http import HTTPStatus
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.api.errors import PROBLEM_JSON
from service.api.settings import Settings


def problem_bytes(status: int, detail: str, code: str, extra_headers: bytes = b"") -> bytes:
    """A whole ``application/problem+json`` HTTP/1.1 response that closes the connection."""
    body = json.dumps(
        {
            "type": f"urn:hoist:error:{code}",
            "title": HTTPStatus(status).phrase,
            "status": status,
            "detail": detail,
            "code": code,
        }
    ).encode()
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
        f"content-type: {PROBLEM_JSON}\r\ncontent-length: {len(body)}\r\nconnection: close\r\n"
    ).encode()
    return head + extra_headers + b"\r\n" + body


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, bounded.

    Class attributes (set by :func:`guarded_protocol`):
        max_head_bytes: largest request head (request line and headers) in bytes; beyond,
            ``431``.
        read_timeout_s: time to receive a whole request (head and body) once it begins,
            and to begin the first one once the connection opens; beyond, ``408``.
        max_connections: open connections; one more is answered ``503`` and closed.
    """

    max_head_bytes = 64 << 10
    read_timeout_s = 10.0
    max_connections = 1024

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_bytes = 0
        self._tail = b""
        self._in_head = True
        self._reading = True
        self._read_timer: asyncio.TimerHandle | None = None
        if len(self.connections) > self.max_connections:
            self._refuse(503, "too many connections are open; try again shortly", "busy", b"retry-after: 1\r\n")
            return
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._read_timer = self.loop.call_later(self.read_timeout_s, self._too_slow)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _refuse(self, status: int, detail: str, code: str, extra_headers: bytes = b"") -> None:
        self._disarm()
        if not self.transport.is_closing():
            self.transport.write(problem_bytes(status, detail, code, extra_headers))
            self.transport.close()

    def _too_slow(self) -> None:
        self._read_timer = None
        if self._reading and (self.cycle is None or not self.cycle.response_started):
            detail = f"the request was not received within {self.read_timeout_s:g} s"
            self._refuse(408, detail, "request_timeout")

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            # count the head's bytes only: a body may follow it in the same chunk
            probe = self._tail + data
            end = probe.find(b"\r\n\r\n")
            self._head_bytes += len(data) if end < 0 else max(end + 4 - len(self._tail), 0)
            self._tail = probe[-3:]
            if self._head_bytes > self.max_head_bytes:
                self._refuse(
                    431,
                    f"the request line and headers are larger than {self.max_head_bytes} bytes",
                    "request_header_fields_too_large",
                )
                return
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._reading = True
        self._head_bytes = 0
        self._tail = b""
        self._arm()

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._reading = False
        self._disarm()
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        self._refuse(400, "the request is not valid HTTP/1.1", "invalid_http_request")


def guarded_protocol(settings: Settings) -> type[GuardedHttpToolsProtocol]:
    """:class:`GuardedHttpToolsProtocol` with the limits of ``settings``."""
    return type(
        "HoistHttpProtocol",
        (GuardedHttpToolsProtocol,),
        {
            "max_head_bytes": settings.max_request_head_bytes,
            "read_timeout_s": settings.request_read_timeout_s,
            "max_connections": settings.max_connections,
        },
    )


def server_config(app: Any, settings: Settings, *, host: str, port: int, log_level: str = "info") -> uvicorn.Config:
    """The uvicorn configuration hoist serves with: uvloop, the guarded httptools
    protocol, and the settings' limits."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http=guarded_protocol(settings),
        log_level=log_level,
        timeout_keep_alive=5,
        # requests still running then are cancelled, which stops their work at its next check
        timeout_graceful_shutdown=10,
    )
