"""The HTTP server: uvicorn (httptools, uvloop) with what it lacks on an exposed port.

uvicorn's httptools protocol reads a request head of any size, waits for a request as
long as a client likes, and answers the requests it refuses itself (malformed, over the
connection limit) in plain text, and keeps a response a client does not read for as long
as the connection lasts. :class:`GuardedHttpToolsProtocol` bounds the head (URL and
headers), the time to receive a whole request and the time a response may wait unread,
refuses connections beyond the limit as they open, and answers all of these as
problem+json.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import resource
from http import HTTPStatus
from typing import Any, cast

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.api.errors import PROBLEM_JSON
from service.api.settings import Settings
from service.logs import log_config

KEEP_ALIVE_S = 5
"""Seconds an idle keep-alive connection stays open."""

WS_MAX_MESSAGE_BYTES = 64 << 10
"""Largest websocket message a client may send (nothing it sends is read)."""

WS_PING_S = 20.0
"""Seconds between websocket pings, and to answer one before the connection is closed."""

FD_MARGIN = 256
"""File descriptors left to loads, dry runs and the process itself however many
connections the settings allow."""

logger = logging.getLogger(__name__)


def raise_open_files_limit() -> int:
    """Raise the process's soft limit on open file descriptors (``RLIMIT_NOFILE``) to its
    hard limit, as servers do; returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = max(soft, 1 << 20) if soft != resource.RLIM_INFINITY else 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= hard:
        return hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (OSError, ValueError):
        return soft
    return hard


def connection_limit(settings: Settings) -> int:
    """The connections served at once: ``settings.max_connections``, but no more than
    half of the file descriptors ``RLIMIT_NOFILE`` allows beyond :data:`FD_MARGIN`, so
    that connections cannot take the descriptors loads need (and refusals beyond the
    limit can still be answered)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return settings.max_connections
    return _connection_limit(settings.max_connections, soft)


@functools.cache
def _connection_limit(max_connections: int, soft: int) -> int:
    allowed = max((soft - FD_MARGIN) // 2, 16)
    if max_connections <= allowed:
        return max_connections
    logger.warning(
        "serving at most %d connections, not %d: the open-file limit (ulimit -n) is %d", allowed, max_connections, soft
    )
    return allowed


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


class _TooManyPipelined(Exception):
    """Raised from a parser callback to stop parsing a connection's pipelined requests."""


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, bounded.

    Every request must arrive whole within ``read_timeout_s`` of its first byte (and the
    first one within that of the connection opening; the next one within that plus the
    keep-alive time of the previous response): a client that dribbles a head, a body, a
    chunked trailer or empty lines is answered ``408`` (or, when its response has
    started, disconnected). A head (request line and headers) is at most
    ``max_head_bytes`` (``431``); the bytes after it, body and trailers, at most
    ``max_body_bytes`` and ``max_head_bytes`` more, whether or not the application reads
    them (``413``); at most ``MAX_PIPELINED`` requests wait behind the one being answered.
    A client that takes nothing of a response for ``send_timeout_s`` (its send buffer
    full) is disconnected at once, dropping what was buffered; a connection being
    closed gets the same time to take its last response.

    Class attributes (set by :func:`guarded_protocol`):
        max_head_bytes: largest request head in bytes.
        max_body_bytes: largest body in bytes.
        read_timeout_s: seconds to receive a whole request.
        keep_alive_s: seconds a connection may stay idle between requests.
        max_connections: open connections; one more is answered ``503`` and closed.
        send_timeout_s: seconds a response may wait unread.
    """

    max_head_bytes = 64 << 10
    max_body_bytes = 1 << 20
    read_timeout_s = 10.0
    keep_alive_s = 5.0
    max_connections = 1024
    send_timeout_s = 10.0
    MAX_PIPELINED = 16

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._read_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._refusal: tuple[int, str, str] | None = None
        self._next_request()
        if len(self.connections) > self.max_connections:
            self._refuse(503, "too many connections are open; try again shortly", "busy", b"retry-after: 1\r\n")
            return
        self._arm(self.read_timeout_s)

    def _next_request(self) -> None:
        """Wait for the next request: its head is counted from the next byte."""
        self._in_head = True
        self._head_started = False
        self._head_bytes = 0
        self._rest_bytes = 0
        self._tail = b""

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._read_timer = self.loop.call_later(seconds, self._too_slow)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _refuse(self, status: int, detail: str, code: str, extra_headers: bytes = b"") -> None:
        self._disarm()
        if not self.transport.is_closing():
            self.transport.write(problem_bytes(status, detail, code, extra_headers))
            self._close()

    def _close(self) -> None:
        """Close once what is buffered is sent, or drop it all if the client does not
        take it within ``send_timeout_s``."""
        self.transport.close()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.send_timeout_s, self._abort)

    def _abort(self) -> None:
        self._send_timer = None
        self.transport.abort()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.send_timeout_s, self._abort)

    def resume_writing(self) -> None:
        if self._send_timer is not None and not self.transport.is_closing():
            self._send_timer.cancel()
            self._send_timer = None
        super().resume_writing()

    def _too_slow(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        if self._in_head or self.cycle is None or not self.cycle.response_started:
            self._refuse(408, f"the request was not received within {self.read_timeout_s:g} s", "request_timeout")
        else:
            self._close()  # the response has begun: nothing more can be said

    def _count(self, data: bytes) -> tuple[int, str, str] | None:
        """Count ``data`` against the head's or the body's bound; the refusal, if over."""
        if not self._in_head:
            self._rest_bytes += len(data)
            if self._rest_bytes > self.max_body_bytes + self.max_head_bytes:
                return 413, f"the request body is larger than {self.max_body_bytes} bytes", "content_too_large"
            return None
        # count the head's bytes only: a body may follow it in the same chunk; empty
        # lines before a request line belong to no head but are counted all the same
        probe = self._tail + data
        start = 0
        if not self._head_started:
            start = len(probe) - len(probe.lstrip(b"\r\n"))
            self._head_started = start < len(probe)
        end = probe.find(b"\r\n\r\n", start) if self._head_started else -1
        self._head_bytes += len(data) if end < 0 else max(end + 4 - len(self._tail), 0)
        self._tail = probe[-3:]
        if self._head_bytes > self.max_head_bytes:
            detail = f"the request line and headers are larger than {self.max_head_bytes} bytes"
            return 431, detail, "request_header_fields_too_large"
        return None

    def data_received(self, data: bytes) -> None:
        refusal = self._count(data)
        if refusal is not None:
            self._refuse(*refusal)
            return
        super().data_received(data)

    def on_message_begin(self) -> None:
        if len(self.pipeline) >= self.MAX_PIPELINED:
            raise _TooManyPipelined
        super().on_message_begin()
        self._arm(self.read_timeout_s)

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        self._next_request()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            # uvicorn's keep-alive timer stops at the next byte; this one does not
            self._arm(self.keep_alive_s + self.read_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        super().connection_lost(exc)

    def handle_websocket_upgrade(self) -> None:
        """Hand the connection to the websocket protocol: the request arrived whole, so
        this protocol's timers stop (the websocket's pings find a client that went away);
        the connection stays counted against ``max_connections``."""
        self._disarm()
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        super().handle_websocket_upgrade()

    def send_400_response(self, msg: str) -> None:
        if len(self.pipeline) >= self.MAX_PIPELINED:
            detail = f"more than {self.MAX_PIPELINED} pipelined requests wait on this connection"
            self._refuse(429, detail, "too_many_pipelined_requests")
        else:
            self._refuse(400, "the request is not valid HTTP/1.1", "invalid_http_request")


def websocket_protocol(**kwargs: Any) -> asyncio.Protocol:
    """uvicorn's sans-I/O ``websockets`` protocol for a connection being upgraded (made
    with uvicorn's keyword arguments); the library is imported with the first websocket,
    not when the server starts."""
    from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

    return WebSocketsSansIOProtocol(**kwargs)


def guarded_protocol(settings: Settings) -> type[GuardedHttpToolsProtocol]:
    """:class:`GuardedHttpToolsProtocol` with the limits of ``settings``."""
    return type(
        "HoistHttpProtocol",
        (GuardedHttpToolsProtocol,),
        {
            "max_head_bytes": settings.max_request_head_bytes,
            "max_body_bytes": settings.max_body_bytes,
            "read_timeout_s": settings.request_read_timeout_s,
            "keep_alive_s": KEEP_ALIVE_S,
            "max_connections": connection_limit(settings),
            "send_timeout_s": settings.send_timeout_s,
        },
    )


def server_config(app: Any, settings: Settings, *, host: str, port: int, log_level: str = "info") -> uvicorn.Config:
    """The uvicorn configuration hoist serves with: uvloop, the guarded httptools
    protocol, websockets (sans-I/O ``websockets``), the settings' limits, and logging in
    the settings' format for every logger, uvicorn's server and access logs included
    (:func:`service.logs.log_config`, applied when the configuration is made)."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http=guarded_protocol(settings),
        log_level=log_level,
        log_config=log_config(settings.log_format, log_level),
        timeout_keep_alive=KEEP_ALIVE_S,
        # websockets (the events of a load): small messages from clients, pings to find
        # the ones that went away or stopped reading; uvicorn calls what it is given
        # with the connection's arguments, as it would a protocol class
        ws=cast(type[asyncio.Protocol], websocket_protocol),
        ws_max_size=WS_MAX_MESSAGE_BYTES,
        ws_ping_interval=WS_PING_S,
        ws_ping_timeout=WS_PING_S,
        ws_per_message_deflate=False,
        # requests still running then are cancelled, which stops their work at its next check
        timeout_graceful_shutdown=10,
    )
