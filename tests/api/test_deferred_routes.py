"""The routers after the probes' are included on first use: the probes are answered
without them, anything else includes them first, and the app's routes and OpenAPI
document are those of an app that included every router at once."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette.routing import Match
from starlette.types import Receive, Scope, Send

from service.api.app import api_routers, create_app
from service.api.routes import health
from service.api.settings import Settings

PROBES = {"/healthz", "/readyz"}


def _app(models_dir: Path, **kwargs: Any) -> FastAPI:
    return create_app(Settings(models_dir=models_dir, cuda=False), **kwargs)


def _operations(app: FastAPI) -> list[tuple[str, str, str]]:
    """(path, method, operationId) of every operation the OpenAPI document gives, in
    its order."""
    return [
        (path, method, op["operationId"]) for path, ops in app.openapi()["paths"].items() for method, op in ops.items()
    ]


@asynccontextmanager
async def _client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """A client of ``app`` in this process, its lifespan run around it (its state given
    to each request, as the server gives it)."""
    async with app.router.lifespan_context(app) as state:

        async def with_state(scope: Scope, receive: Receive, send: Send) -> None:
            await app({**scope, "state": dict(state)}, receive, send)

        transport = httpx.ASGITransport(app=with_state)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client


def _included(app: FastAPI) -> bool:
    scope = {"type": "http", "path": "/v1/loads", "method": "GET", "root_path": "", "headers": []}
    return any(route.matches(scope)[0] is Match.FULL for route in app.router.routes)


def test_the_openapi_document_is_the_one_of_an_app_with_every_router(models_dir: Path) -> None:
    deferred = _app(models_dir)
    eager = _app(models_dir, defer_routes=False)
    assert _included(eager) and not _included(deferred)
    # the same document, key order included (the routes' order gives the paths')
    assert json.dumps(deferred.openapi()) == json.dumps(eager.openapi())
    assert _included(deferred)
    assert _operations(deferred) == _operations(eager)
    paths = {path for path, _, _ in _operations(eager)}
    assert PROBES | {"/v1/loads", "/v1/loads/{job_id}/events", "/v1/plans", "/v1/models", "/metrics"} <= paths
    components = deferred.openapi()["components"]["schemas"]
    assert {"Health", "Ready", "LoadRequest", "LoadJobOut", "DeviceList", "FileList"} <= set(components)


def test_every_route_in_the_same_order(models_dir: Path) -> None:
    deferred = _app(models_dir)
    eager = _app(models_dir, defer_routes=False)
    deferred.openapi()  # includes the rest

    def described(app: FastAPI) -> list[tuple[str, object]]:
        """Each route: an included router by its (module-level) router, any other by path."""
        return [
            ("router", id(r.original_router)) if hasattr(r, "original_router") else (type(r).__name__, r.path)  # type: ignore[attr-defined]
            for r in app.routes
        ]

    assert described(deferred) == described(eager)
    assert [("router", id(router)) for router in [health.router, *api_routers()]] == described(eager)[-8:]


def test_no_deferred_route_serves_a_probe_path() -> None:
    """A probe's request is answered the same whether or not the rest is included."""
    assert {r.path for r in health.router.routes if isinstance(r, APIRoute)} == PROBES
    for router in api_routers():
        for route in router.routes:
            for path in PROBES:
                for method in ("GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS"):
                    scope = {"type": "http", "path": path, "method": method, "root_path": "", "headers": []}
                    assert route.matches(scope)[0] is Match.NONE, (route, path, method)


async def test_probes_are_answered_before_the_rest_is_included(models_dir: Path) -> None:
    app = _app(models_dir)
    async with _client(app) as client:
        assert (await client.get("/healthz")).json() == {"status": "ok"}
        assert (await client.head("/healthz")).status_code == 200
        assert (await client.get("/readyz")).json() == {"status": "ready", "models": []}
        resp = await client.post("/healthz")
        assert resp.status_code == 405 and resp.headers["allow"] == "GET, HEAD"
        assert not _included(app)
        # the request metrics label the probes by their route, as with every router
        metrics = await client.get("/metrics")
        assert _included(app)
        for probe in ("/healthz", "/readyz"):
            assert f'hoist_http_requests_total{{handler="{probe}",method="GET",status="2xx"}} 1.0' in metrics.text
        assert 'hoist_http_requests_total{handler="/healthz",method="POST",status="4xx"} 1.0' in metrics.text
        assert (await client.get("/v1/loads")).json()["data"] == []


@pytest.mark.parametrize("path", ["/v1/devices", "/nowhere", "/healthz/", "/docs", "/openapi.json"])
async def test_any_other_request_includes_the_rest_first(models_dir: Path, path: str) -> None:
    app = _app(models_dir)
    eager = _app(models_dir, defer_routes=False)
    async with _client(app) as client, _client(eager) as eager_client:
        got = await client.get(path)
        assert _included(app)
        want = await eager_client.get(path)
        assert got.status_code == want.status_code
        assert got.headers.get("content-type") == want.headers.get("content-type")
        assert got.headers.get("location") == want.headers.get("location")
        if path != "/v1/devices":  # free memory changes between the two
            assert got.content == want.content
        # the first request is labelled by its route in the metrics, as with every router
        counted = [
            sorted(
                line
                for line in (await c.get("/metrics")).text.splitlines()
                if line.startswith("hoist_http_requests_total")
            )
            for c in (client, eager_client)
        ]
        assert counted[0] == counted[1] and len(counted[0]) == 1
