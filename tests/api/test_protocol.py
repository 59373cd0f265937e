"""The HTTP server itself, before the application: request heads and their read time are
bounded, connections beyond the limit refused, and everything it refuses is answered as
problem+json, on a real ``hoist serve``."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import httpx

from tests.conftest import ServeProcess


def _connect(server: ServeProcess) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.settimeout(10)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return out


def _problem(raw: bytes, status: int, code: str) -> dict[str, Any]:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode()), raw[:300]
    assert b"content-type: application/problem+json" in head.lower()
    problem: dict[str, Any] = json.loads(body)
    assert problem["status"] == status and problem["code"] == code
    return problem


def test_a_huge_header_is_refused_without_reading_it(hoist_serve: Any) -> None:
    server: ServeProcess = hoist_serve(HOIST_API_TOKEN="a-token-for-tests")
    cpu = server.cpu_seconds()
    rss = server.rss()
    sock = _connect(server)
    sock.sendall(b"GET /v1/devices HTTP/1.1\r\nHost: x\r\nX-A: ")
    refused = False
    try:
        for _ in range(64):  # up to 64 MiB, a MiB at a time
            sock.sendall(b"a" * (1 << 20))
    except (BrokenPipeError, ConnectionResetError):
        refused = True
    raw = _read_all(sock)
    sock.close()
    assert refused or raw
    if raw:
        _problem(raw, 431, "request_header_fields_too_large")
    assert server.cpu_seconds() - cpu < 2
    assert server.rss() < rss + (16 << 20)
    assert httpx.get(f"{server.url}/healthz").status_code == 200


def test_a_body_after_the_head_in_one_packet_is_not_counted_as_head(hoist_serve: Any) -> None:
    server: ServeProcess = hoist_serve()
    body = json.dumps({"model": "m.gguf", "override_tensor": ["x" * 200 + "=CPU"] * 400}).encode()
    assert len(body) > 64 << 10
    sock = _connect(server)
    sock.sendall(
        b"POST /v1/plans HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )
    raw = _read_all(sock)
    sock.close()
    assert raw.startswith(b"HTTP/1.1 404 "), raw[:200]  # the model is missing: the body was read


def test_slow_and_idle_clients_are_timed_out(hoist_serve: Any) -> None:
    server: ServeProcess = hoist_serve(HOIST_REQUEST_READ_TIMEOUT_S="1")
    slow_head = _connect(server)
    slow_head.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
    slow_body = _connect(server)
    slow_body.sendall(b"POST /v1/plans HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    idle = _connect(server)
    started = time.monotonic()
    for sock in (slow_head, slow_body, idle):
        _problem(_read_all(sock), 408, "request_timeout")
        sock.close()
    assert time.monotonic() - started < 8
    # a request that arrives in time is served as usual, several on one connection
    with httpx.Client(base_url=server.url) as client:
        for _ in range(3):
            assert client.get("/healthz").status_code == 200


def test_connections_beyond_the_limit_are_refused_as_they_open(hoist_serve: Any) -> None:
    server: ServeProcess = hoist_serve(HOIST_MAX_CONNECTIONS="8", HOIST_REQUEST_READ_TIMEOUT_S="30")
    held = [_connect(server) for _ in range(8)]
    time.sleep(0.3)
    extra = _connect(server)
    problem = _problem(_read_all(extra), 503, "busy")
    assert "connections" in problem["detail"]
    extra.close()
    for sock in held:
        sock.close()
    time.sleep(0.3)
    assert httpx.get(f"{server.url}/healthz").status_code == 200


def test_invalid_http_is_a_problem(hoist_serve: Any) -> None:
    server: ServeProcess = hoist_serve()
    for request in (
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"NOT HTTP AT ALL\r\n\r\n",
    ):
        sock = _connect(server)
        sock.sendall(request)
        _problem(_read_all(sock), 400, "invalid_http_request")
        sock.close()
    assert httpx.get(f"{server.url}/healthz").status_code == 200


def _drip(sock: socket.socket, chunk: bytes, seconds: float, every: float = 0.3) -> bool:
    """Send ``chunk`` every ``every`` seconds for ``seconds``; False once the server closed."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            return False
        time.sleep(every)
    return True


def test_dribbling_clients_are_cut_off_whatever_they_dribble(hoist_serve: Any) -> None:
    server: ServeProcess = hoist_serve(HOIST_REQUEST_READ_TIMEOUT_S="1", HOIST_API_TOKEN="a-token-for-tests")
    done = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    cases = {
        # after one request: empty lines, or a second head, a byte at a time
        "empty lines": (done, b"\r\n"),
        "second head": (done + b"GET /healthz HTTP/1.1\r\n", b"X"),
        # a body nobody reads, chunked, without end (the response was sent already)
        "endless chunked body": (
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"1\r\na\r\n",
        ),
        # a body refused by its length, then sent anyway, slowly
        "refused body": (b"POST /v1/plans HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n\r\n", b"a"),
        # trailers after a chunked body, one after another (the 401 was sent already)
        "endless trailers": (
            b"POST /v1/loads HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n",
            b"a:b\r\n",
        ),
    }
    for what, (first, then) in cases.items():
        sock = _connect(server)
        sock.sendall(first)
        still_open = _drip(sock, then, seconds=12)
        sock.close()
        assert not still_open, f"{what}: the connection stayed open"
    assert server.rss() < 400 << 20


def test_trailers_and_bodies_are_bounded_even_unread(hoist_serve: Any) -> None:
    server: ServeProcess = hoist_serve(HOIST_API_TOKEN="a-token-for-tests")
    rss = server.rss()
    sock = _connect(server)
    sock.sendall(b"POST /v1/loads HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n")
    closed = False
    try:
        for _ in range(400):  # up to 40 MB of trailers
            sock.sendall(b"a:b\r\n" * 20_000)
    except (BrokenPipeError, ConnectionResetError):
        closed = True
    sock.close()
    assert closed
    assert server.rss() < rss + (64 << 20)


def test_pipelined_requests_are_bounded(hoist_serve: Any) -> None:
    server: ServeProcess = hoist_serve()
    rss = server.rss()
    sock = _connect(server)
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    closed = False
    try:
        for _ in range(200):  # up to 6.6 MB of pipelined requests, sent without reading
            sock.sendall(request * 1000)
    except (BrokenPipeError, ConnectionResetError):
        closed = True
    raw = _read_all(sock)
    sock.close()
    assert closed or b"too_many_pipelined_requests" in raw
    assert server.rss() < rss + (64 << 20)
    # a client that pipelines a few requests is served
    sock = _connect(server)
    sock.sendall(request * 4 + b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert _read_all(sock).count(b"HTTP/1.1 200 OK") == 5
    sock.close()


def test_empty_lines_before_a_head_do_not_hide_it(hoist_serve: Any) -> None:
    server: ServeProcess = hoist_serve()
    sock = _connect(server)
    sock.sendall(b"\r\n\r\n" + b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * (200 << 10) + b"\r\n\r\n")
    _problem(_read_all(sock), 431, "request_header_fields_too_large")
    sock.close()


def test_a_response_left_unread_is_dropped(hoist_serve: Any, models_dir: Any) -> None:
    from tests.api.test_limits import _many_tensors

    _many_tensors(models_dir / "many.gguf", 40_000)  # a plan of about 10 MB
    server: ServeProcess = hoist_serve(HOIST_SEND_TIMEOUT_S="1")
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    body = b'{"model": "many.gguf"}'
    sock.sendall(
        b"POST /v1/plans HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    time.sleep(8)  # planned, encoded, then left unread for longer than the send time limit
    sock.settimeout(10)
    raw = _read_all(sock)
    sock.close()
    head, _, got = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")).split(b":")[1])
    assert length > 4 << 20 and len(got) < length  # cut off, its buffer dropped
    # a client that reads gets the whole response
    with httpx.Client(base_url=server.url, timeout=60) as client:
        assert len(client.post("/v1/plans", json={"model": "many.gguf"}).content) == length


def test_connections_leave_descriptors_for_loads(monkeypatch: Any) -> None:
    import resource

    from service.api import server as server_module
    from service.api.settings import Settings

    settings = Settings(models_dir=".", cuda=False, max_connections=1024)
    limits = {"soft": 1024}
    monkeypatch.setattr(resource, "getrlimit", lambda _: (limits["soft"], 4096))
    assert server_module.connection_limit(settings) == (1024 - server_module.FD_MARGIN) // 2
    limits["soft"] = 1 << 16
    assert server_module.connection_limit(settings) == 1024
    monkeypatch.setattr(resource, "setrlimit", lambda _, value: limits.update(soft=value[0]))
    limits["soft"] = 1024
    assert server_module.raise_open_files_limit() == 4096 and limits["soft"] == 4096
