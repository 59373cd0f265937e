"""Routers included on first use: the app starts with the routes its probes need
(``/healthz``, ``/readyz``) and includes the others, importing their modules and building
their request and response models, when the first request for any other path arrives or
the OpenAPI document is first asked for.

The app then has the same routes, in the same order, with the same OpenAPI document as
one that included them all at once; the first such request waits for them (about as long
as the start would have). A request for a probe's path is answered by the probe's route
whether the others are included or not: no other route serves those paths (the tests
check it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from fastapi import APIRouter, FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send


class DeferredRouters:
    """The routers of ``app`` not yet included, and the paths served without them.

    ``app.openapi`` is wrapped so that the document is made with every route.

    Args:
        app: the application (its probes' routers already included).
        routers: returns the routers to include, in order (it imports their modules).
        eager_paths: request paths served without the deferred routers (exact match of
            the scope's ``path``; any other path includes them first).
    """

    def __init__(self, app: FastAPI, routers: Callable[[], Iterable[APIRouter]], eager_paths: Iterable[str]) -> None:
        self.app = app
        self.eager_paths = frozenset(eager_paths)
        self.included = False
        self._routers = routers
        self._lock = threading.Lock()
        openapi = app.openapi

        def complete_openapi() -> dict[str, Any]:
            self.include()
            return openapi()

        app.openapi = complete_openapi  # type: ignore[method-assign]

    def include(self) -> None:
        """Include the deferred routers (once; later calls return at once)."""
        if self.included:
            return
        with self._lock:
            if not self.included:
                for router in self._routers():
                    self.app.include_router(router)
                self.included = True

    def needed_by(self, scope: Scope) -> bool:
        """Whether answering ``scope`` may need a deferred route (any HTTP or websocket
        request but one for an eager path)."""
        return scope["type"] in ("http", "websocket") and scope["path"] not in self.eager_paths


class IncludeOnFirstUse:
    """Middleware that includes the deferred routers before the first request that may
    need them goes on (it must lie outside every middleware that reads the routes, such
    as the request metrics').

    Args:
        app: the application.
        routers: the deferred routers.
    """

    def __init__(self, app: ASGIApp, routers: DeferredRouters) -> None:
        self.app = app
        self.routers = routers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.routers.included and self.routers.needed_by(scope):
            self.routers.include()
        await self.app(scope, receive, send)
