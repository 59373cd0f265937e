"""``/healthz``: liveness, independent of any model's state."""

from __future__ import annotations

from fastapi import APIRouter

from service.api.schemas import Health

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """200 while the event loop answers (``HEAD`` too, as on every ``GET`` route)."""
    return Health()
