"""Dependencies the routes take from the app's lifespan state and the request."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import Depends, Request

from service.api.jobs import JobManager
from service.api.offload import Watch
from service.loader.devices import Device

DISCONNECT_POLL_S = 0.2
"""How often a request with blocking work checks whether its client went away."""


async def get_jobs(request: Request) -> JobManager:
    jobs: JobManager = request.state.jobs
    return jobs


async def get_devices(request: Request) -> list[Device]:
    devices: list[Device] = request.state.devices
    return devices


async def client_gone(request: Request) -> Watch:
    """A coroutine function that returns once the client of ``request`` disconnected."""

    async def watch() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)

    return watch


JobsDep = Annotated[JobManager, Depends(get_jobs)]
DevicesDep = Annotated[list[Device], Depends(get_devices)]
ClientGoneDep = Annotated[Watch, Depends(client_gone)]
