"""Dependencies the routes take from the app's lifespan state."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from service.api.jobs import JobManager
from service.loader.devices import Device


def get_jobs(request: Request) -> JobManager:
    jobs: JobManager = request.state.jobs
    return jobs


def get_devices(request: Request) -> list[Device]:
    devices: list[Device] = request.state.devices
    return devices


JobsDep = Annotated[JobManager, Depends(get_jobs)]
DevicesDep = Annotated[list[Device], Depends(get_devices)]
