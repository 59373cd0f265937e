"""Service settings, from ``HOIST_*`` environment variables or the CLI."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Settings of one service instance."""

    model_config = SettingsConfigDict(env_prefix="HOIST_", extra="ignore")

    models_dir: Path = Field(default=Path("models"))
    """Directory that request paths are relative to; requests cannot leave it
    (``HOIST_MODELS_DIR``)."""

    max_concurrent_loads: int = Field(default=1, ge=1)
    """Loads that run at once; further loads wait in state ``queued``
    (``HOIST_MAX_CONCURRENT_LOADS``)."""

    emulated_devices: str | None = Field(default=None)
    """Emulated GPUs to offer, as ``EMU0=3000MiB,EMU1=1000MiB`` (``HOIST_EMULATED_DEVICES``)."""

    cuda: bool = Field(default=True)
    """Use CUDA GPUs through PyTorch when available (``HOIST_CUDA``)."""

    job_history: int = Field(default=256, ge=1)
    """Ended load jobs kept for listing (``HOIST_JOB_HISTORY``)."""

    @field_validator("emulated_devices")
    @classmethod
    def _emulated_devices_parse(cls, value: str | None) -> str | None:
        from service.errors import HoistError
        from service.loader.devices import parse_emulated_devices

        try:
            parse_emulated_devices(value)
        except HoistError as exc:
            raise ValueError(exc.describe()) from None
        return value

    @field_validator("models_dir")
    @classmethod
    def _models_dir_exists(cls, value: Path) -> Path:
        if not value.is_dir():
            raise ValueError(f"models directory {value} does not exist or is not a directory")
        return value.resolve()
