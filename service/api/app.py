"""The FastAPI application; its lifespan owns the job manager and the devices."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute
from fastapi_offline import FastAPIOffline

from service import __version__
from service.api import errors
from service.api.auth import BearerAuth
from service.api.deferred import DeferredRouters, IncludeOnFirstUse
from service.api.head import HeadAsGet
from service.api.jobs import JobManager, Limits
from service.api.limits import BodyLimit
from service.api.metrics import Metrics
from service.api.routes import health
from service.api.server import connection_limit
from service.api.settings import Settings, preload_specs
from service.io.buffer_cache import HOST_BUFFER_CACHE
from service.loader.devices import discover_devices
from service.loader.gguf import HeaderLimits

logger = logging.getLogger(__name__)


def limits_from(settings: Settings) -> Limits:
    """The job manager's limits from the service settings."""
    return Limits(
        max_concurrent_loads=settings.max_concurrent_loads,
        max_queued_loads=settings.max_queued_loads,
        max_resident_models=settings.max_resident_models,
        job_history=settings.job_history,
        request_workers=settings.request_workers,
        max_waiting_requests=settings.max_waiting_requests,
        request_timeout_s=settings.request_timeout_s,
        override_budget_s=settings.override_budget_s,
        file_check_interval_s=settings.file_check_interval_s,
        load_timeout_s=settings.load_timeout_s,
        descriptors_kept=connection_limit(settings),
        keep_alive_s=settings.keep_alive_s(),
        evict_idle=settings.evict_idle,
        callback_hosts=settings.callback_hosts,
        callback_secret=settings.callback_secret.get_secret_value() if settings.callback_secret else None,
        callback_timeout_s=settings.callback_timeout_s,
        callback_retry_s=settings.callback_retry_s,
        header_limits=HeaderLimits(
            settings.max_gguf_header_bytes, settings.max_kv_pairs, settings.max_tensors, settings.max_splits
        ),
    )


def api_routers() -> Iterable[APIRouter]:
    """The routers after the probes', in the order the app includes them (their modules
    are imported here)."""
    from service.api.routes import devices, events, files, loads, metrics, models, plans

    return [module.router for module in (loads, events, plans, models, files, devices, metrics)]


def create_app(settings: Settings | None = None, *, defer_routes: bool = True) -> FastAPI:
    """Build the app. Settings come from ``HOIST_*`` environment variables when not given.

    With ``defer_routes``, only the probes' routes (``/healthz``, ``/readyz``) are
    included now, and the others (:func:`api_routers`) on first use
    (:mod:`~service.api.deferred`); either way the app serves the same routes with the
    same OpenAPI document.

    Raises:
        pydantic.ValidationError: invalid settings (e.g. a missing models directory).
    """
    settings = settings or Settings()
    token = settings.token()
    telemetry = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        devices = discover_devices(settings.emulated_devices, cuda=settings.cuda)
        HOST_BUFFER_CACHE.configure(settings.host_buffer_cache_bytes)
        jobs = JobManager(str(settings.models_dir), devices, limits_from(settings))
        telemetry.loads.bind(devices)
        jobs.runner.observer = telemetry.loads
        jobs.start()
        jobs.preload(preload_specs(settings.preload))
        logger.info("serving models from %s on %s", settings.models_dir, ", ".join(d.name for d in devices))
        try:
            yield {"jobs": jobs, "devices": devices, "settings": settings, "metrics": telemetry}
        finally:
            await jobs.close()
            telemetry.close()
            HOST_BUFFER_CACHE.configure(0)

    # /docs and /redoc with Swagger UI's and ReDoc's assets served from
    # /static-offline-docs (no CDN); no online validator badge either
    app = FastAPIOffline(
        title="hoist", version=__version__, lifespan=lifespan, swagger_ui_parameters={"validatorUrl": None}
    )
    errors.install(app)
    app.include_router(health.router)
    probes = [route.path for route in health.router.routes if isinstance(route, APIRoute)]
    deferred = DeferredRouters(app, api_routers, probes)
    if not defer_routes:
        deferred.include()
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    if token is not None:
        app.add_middleware(BearerAuth, token=token)
    app.add_middleware(HeadAsGet)
    # outside the token check, so that refused requests are counted too
    telemetry.instrument(app)
    # outside the metrics, which read the routes to label a request
    app.add_middleware(IncludeOnFirstUse, routers=deferred)
    app.add_middleware(errors.UnhandledErrors)
    return app
