"""``/v1/devices``: devices, their memory, and what each loaded model holds there."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter

from service.api.deps import DevicesDep, JobsDep
from service.api.schemas import COMMON_PROBLEMS, DeviceList, DeviceModelUse, DeviceOut

router = APIRouter(prefix="/v1/devices", tags=["devices"], responses=COMMON_PROBLEMS)


@router.get("", response_model=DeviceList)
async def list_devices(devices: DevicesDep, jobs: JobsDep) -> DeviceList:
    """Every device with free/total memory and the bytes each loaded model holds there
    per buffer type."""
    # a device's memory query can be slow (CUDA): on a thread, all devices at once
    infos = await asyncio.to_thread(lambda: [device.to_dict() for device in devices])
    out = []
    for device, info in zip(devices, infos, strict=True):
        uses = []
        for resident in jobs.models.values():
            per_type = resident.by_device.get(device.name)
            if per_type:
                uses.append(
                    DeviceModelUse(
                        model_id=resident.id,
                        name=resident.name,
                        model=resident.model,
                        buffer_types=per_type,
                        total_bytes=sum(per_type.values()),
                    )
                )
        info["reserved_bytes"] = jobs.reservations.reserved(device.name)[0]
        out.append(DeviceOut(**info, models=uses, used_by_models_bytes=sum(u.total_bytes for u in uses)))
    return DeviceList(data=out)
