"""``HEAD`` is answered wherever ``GET`` is, as ``GET`` would be without the body; ``405``
answers name every method the path serves."""

from __future__ import annotations

import re
import socket
import tempfile
from pathlib import Path

import httpx
import pytest

from service.api.app import create_app
from service.api.settings import Settings
from tests.api.test_hostile import is_problem
from tests.api.test_loads import put, wait_for
from tests.helpers import Fixture


def _get_paths() -> list[str]:
    """Every GET route of the app, as the OpenAPI schema lists it, ids filled in."""
    with tempfile.TemporaryDirectory() as d:
        schema = create_app(Settings(models_dir=Path(d), cuda=False)).openapi()
    paths = [path for path, operations in schema["paths"].items() if "get" in operations]
    assert "/v1/loads" in paths and "/healthz" in paths
    return paths


@pytest.mark.parametrize("path", _get_paths())
def test_head_answers_as_get_does_without_the_body(
    live_server: str, models_dir: Path, all_types_fixture: Fixture, path: str
) -> None:
    name = put(models_dir, all_types_fixture)
    with httpx.Client(base_url=live_server, timeout=30) as client:
        resp = client.post("/v1/loads", json={"model": name})
        job = wait_for(client, resp.headers["location"], {"succeeded", "failed"})
        assert job["state"] == "succeeded", job
        url = re.sub(r"\{[a-z_]+\}", job["id"], path)
        for target in (url, re.sub(r"\{[a-z_]+\}", "lj_none", path)):  # found, and 404 where ids are
            got = client.get(target)
            head = client.head(target)
            assert head.status_code == got.status_code, (target, head.status_code, got.status_code)
            assert head.content == b""
            assert head.headers["content-type"] == got.headers["content-type"]
            if got.headers["content-type"].startswith("text/event-stream"):
                assert "content-length" not in head.headers and len(got.content) > 0  # a stream
            elif path == "/metrics":  # measured anew for each request: its length varies
                assert int(head.headers["content-length"]) > 0 and len(got.content) > 0
            else:
                assert int(head.headers["content-length"]) == len(got.content) > 0


def test_a_head_response_has_no_body_on_the_wire(live_server: str) -> None:
    host, port = live_server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        # two requests on one connection: the second answer must follow the first's head
        sock.sendall(b"HEAD /v1/loads HTTP/1.1\r\nHost: x\r\n\r\nGET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        raw = b""
        while raw.count(b"HTTP/1.1 ") < 2 or not raw.endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            raw += chunk
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 "), raw
    assert re.search(rb"(?im)^content-length: *([1-9][0-9]*)\r?$", head)
    assert rest.startswith(b"HTTP/1.1 200 "), rest[:200]
    assert rest.endswith(b'{"status":"ok"}')


def test_405_names_every_method_of_the_path(live_server: str) -> None:
    with httpx.Client(base_url=live_server) as client:
        for method, path, allow in [
            ("PUT", "/v1/loads", "GET, HEAD, POST"),
            ("OPTIONS", "/v1/loads", "GET, HEAD, POST"),
            ("HEAD", "/v1/plans", "POST"),
            ("OPTIONS", "/v1/loads/lj_x/cancel", "POST"),
            ("PATCH", "/v1/models/x", "GET, HEAD, DELETE"),
            ("DELETE", "/healthz", "GET, HEAD"),
        ]:
            resp = client.request(method, path)
            assert resp.status_code == 405, (method, path)
            assert resp.headers["allow"] == allow, (method, path)
            if method != "HEAD":
                is_problem(resp, 405, "method_not_allowed")
