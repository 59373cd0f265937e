"""The FastAPI application; its lifespan owns the job manager and the devices."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from service import __version__
from service.api import errors
from service.api.jobs import JobManager
from service.api.routes import devices, health, loads, models, plans
from service.api.settings import Settings
from service.loader.devices import discover_devices

logger = logging.getLogger(__name__)


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app. Settings come from ``HOIST_*`` environment variables when not given.

    Raises:
        pydantic.ValidationError: invalid settings (e.g. a missing models directory).
    """
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        devices = discover_devices(settings.emulated_devices, cuda=settings.cuda)
        jobs = JobManager(str(settings.models_dir), devices, settings.max_concurrent_loads, settings.job_history)
        logger.info("serving models from %s on %s", settings.models_dir, ", ".join(d.name for d in devices))
        try:
            yield {"jobs": jobs, "devices": devices, "settings": settings}
        finally:
            await jobs.close()

    app = FastAPI(title="hoist", version=__version__, lifespan=lifespan)
    errors.install(app)
    for router in (health.router, loads.router, plans.router, models.router, devices.router):
        app.include_router(router)
    return app
