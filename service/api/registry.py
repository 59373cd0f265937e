"""Resident models: their names, the references loads hold on them, their keep-alive
timers, least-recently-used eviction, and the check of their mapped files.

A model is registered under the id of the job that loaded it and under a name (by
default its path relative to the models directory). Loads of the same files with the
same resolved placement share it: each adds a reference, each unload drops one, and
its memory is freed with the last. Its keep-alive (Ollama's ``keep_alive``) is the one
of the load that referenced it last, counted from then; when it runs out, the model is
unloaded whatever its references.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from service.api.admission import Reservations
from service.api.spec import ShareKey
from service.errors import ConflictError, NotFoundError, clip

if TYPE_CHECKING:
    from service.loader.model import LoadedModel

logger = logging.getLogger(__name__)


class NameTakenError(ConflictError):
    """The name is held by a model loaded from other files or with another placement."""

    code = "name_taken"


class LoadInProgressError(ConflictError):
    """A load of the same model under the same name is queued or running."""

    code = "load_in_progress"


def _now() -> datetime:
    return datetime.now(UTC)


@dataclass(eq=False)
class ResidentModel:
    """A model in memory, held until its last reference is dropped or its keep-alive
    runs out.

    Attributes:
        id: the id of the job that loaded it.
        name: the name it is hosted under.
        model: its path relative to the models directory.
        key: what a load must have alike to share it (:func:`~service.api.spec.share_key`).
        checked: whether its tensor data was validated as it loaded (check-tensors).
        hashed: whether its tensors were hashed as it loaded (hash-tensors).
        references: loads holding it (the first load's, and one per shared load).
        keep_alive_s: seconds it stays after the last load that referenced it (negative:
            until unloaded).
        expires_at: when the keep-alive runs out (None: never).
        by_device: bytes it holds per device and buffer type (computed once: a split
            model mapped has a buffer per split).
    """

    id: str
    name: str
    model: str
    loaded: LoadedModel
    key: ShareKey = ()
    checked: bool = False
    hashed: bool = False
    references: int = 1
    keep_alive_s: float = -1.0
    loaded_at: datetime = field(default_factory=_now)
    last_used_at: datetime = field(default_factory=_now)
    expires_at: datetime | None = None
    by_device: dict[str, dict[str, int]] = field(default_factory=dict)
    last_used: float = field(default_factory=time.monotonic, repr=False)
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.by_device = self.loaded.report.by_device()


Freed = Callable[[ResidentModel, str], None]
"""Called when a model's memory is freed, with the reason: ``unloaded`` (its last
reference dropped), else why it was unloaded whatever its references (keep-alive,
eviction, a changed file, shutdown), as a sentence."""


class ModelRegistry:
    """The resident models of one service.

    Args:
        reservations: where each model's memory is reserved (released once it is freed).
        models_dir: the models directory (to name files in logs).
        on_freed: called once a model is freed.
        file_check_interval_s: how often mapped files are checked (0: never).
    """

    def __init__(
        self, reservations: Reservations, models_dir: str, on_freed: Freed, file_check_interval_s: float = 0.0
    ) -> None:
        self.reservations = reservations
        self.models_dir = models_dir
        self.on_freed = on_freed
        self.file_check_interval_s = file_check_interval_s
        self.models: dict[str, ResidentModel] = {}
        self.by_name: dict[str, ResidentModel] = {}
        self.job_models: dict[str, str] = {}
        self._freeing: set[asyncio.Task[None]] = set()
        self._watcher: asyncio.Task[None] | None = None

    # -- lookup -------------------------------------------------------------------

    def find(self, ref: str) -> ResidentModel:
        """The resident model whose id, name, or the id of a load that referenced it is
        ``ref``. Raises NotFoundError."""
        resident = self.models.get(ref) or self.by_name.get(ref)
        if resident is None and ref in self.job_models:
            resident = self.models.get(self.job_models[ref])
        if resident is None:
            raise NotFoundError(f"no loaded model '{clip(ref, 100)}'")
        return resident

    def shareable(
        self, name: str | None, key: ShareKey, *, checked: bool, hashed: bool = False
    ) -> ResidentModel | None:
        """The resident model a load of ``key`` can share: the one named ``name`` (when
        given) if its key is ``key``, else any of that key; a load that validates its
        data (``checked``) shares only a model that was validated, one that hashes it
        (``hashed``) only a model that was hashed."""
        candidates = [self.by_name[name]] if name is not None and name in self.by_name else []
        if name is None:
            candidates = list(self.models.values())
        for resident in candidates:
            if resident.key == key and (resident.checked or not checked) and (resident.hashed or not hashed):
                return resident
        return None

    # -- references and timers ----------------------------------------------------

    def add(self, resident: ResidentModel) -> None:
        """Register a model just loaded, with its first reference, and start its
        keep-alive."""
        self.models[resident.id] = resident
        self.by_name[resident.name] = resident
        self.job_models[resident.id] = resident.id
        self._touch(resident, resident.keep_alive_s)

    def attach(self, resident: ResidentModel, job_id: str, keep_alive_s: float) -> None:
        """Add a reference from the load ``job_id``; its keep-alive restarts the timer."""
        resident.references += 1
        self.job_models[job_id] = resident.id
        self._touch(resident, keep_alive_s)

    def forget_job(self, job_id: str) -> None:
        """Stop finding models by the id of a job that is no longer kept."""
        if self.job_models.get(job_id) != job_id or job_id not in self.models:
            self.job_models.pop(job_id, None)

    def _touch(self, resident: ResidentModel, keep_alive_s: float) -> None:
        resident.keep_alive_s = keep_alive_s
        resident.last_used = time.monotonic()
        resident.last_used_at = _now()
        if resident.timer is not None:
            resident.timer.cancel()
            resident.timer = None
        if keep_alive_s < 0:
            resident.expires_at = None
            return
        resident.expires_at = resident.last_used_at + timedelta(seconds=keep_alive_s)
        loop = asyncio.get_running_loop()
        resident.timer = loop.call_later(keep_alive_s, self._expire, resident)

    def _expire(self, resident: ResidentModel) -> None:
        resident.timer = None
        if self.models.get(resident.id) is resident:
            logger.info("unloading %s (%s): its keep_alive ran out", resident.name, resident.id)
            self._spawn(self.remove(resident, "its keep_alive ran out"))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._freeing.add(task)
        task.add_done_callback(self._freeing.discard)

    # -- unloading ----------------------------------------------------------------

    async def release(self, ref: str) -> tuple[ResidentModel, bool]:
        """Drop one reference of the model ``ref`` (as :meth:`find` takes it); the last
        one frees it (off the event loop). Returns the model and whether it was freed.
        Raises NotFoundError."""
        resident = self.find(ref)
        resident.references -= 1
        if resident.references > 0:
            return resident, False
        await self.remove(resident, "unloaded")
        return resident, True

    async def remove(self, resident: ResidentModel, reason: str) -> None:
        """Unload ``resident`` whatever its references: it is no longer found at once, its
        buffers and mappings are released on a thread (freeing big buffers and device
        memory can take a while), then its reservation."""
        if self.models.get(resident.id) is not resident:
            return
        del self.models[resident.id]
        if self.by_name.get(resident.name) is resident:
            del self.by_name[resident.name]
        for job_id in [j for j, m in self.job_models.items() if m == resident.id]:
            del self.job_models[job_id]
        if resident.timer is not None:
            resident.timer.cancel()
            resident.timer = None
        resident.references = 0
        resident.expires_at = None
        try:
            await asyncio.to_thread(resident.loaded.close)
        finally:
            self.reservations.release(resident.id)
            self.on_freed(resident, reason)

    def idle_by_age(self) -> list[ResidentModel]:
        """Resident models, least recently used first (eviction candidates: a load that
        shares a model references it at once, so no resident model waits on a load)."""
        return sorted(self.models.values(), key=lambda r: r.last_used)

    def victims(self, fits: Callable[[set[str]], bool]) -> list[ResidentModel] | None:
        """The fewest least-recently-used models whose unloading makes ``fits`` true
        (given the ids unloaded), in that order; None if unloading every one would not."""
        chosen: list[ResidentModel] = []
        for resident in self.idle_by_age():
            chosen.append(resident)
            if fits({r.id for r in chosen}):
                return chosen
        return None

    # -- mapped files -------------------------------------------------------------

    def start(self) -> None:
        """Start the background check of resident models' mapped files."""
        if self._watcher is None and self.file_check_interval_s > 0:
            self._watcher = asyncio.create_task(self._watch_files(), name="hoist file check")

    def changed(self) -> list[tuple[ResidentModel, str]]:
        """Resident models whose mapped files changed (shrank or were rewritten) since they
        were mapped, with how."""
        out = []
        for resident in list(self.models.values()):
            changed = resident.loaded.changed_files()
            if changed:
                how = "; ".join(f"{os.path.relpath(path, self.models_dir)}: {what}" for path, what in changed)
                out.append((resident, how))
        return out

    async def check_files(self) -> list[str]:
        """Unload every resident model whose mapped files changed; returns their ids.
        Nothing in the service reads a model's pages afterwards, so a shrunk file cannot
        raise SIGBUS here."""
        gone = []
        for resident, how in await asyncio.to_thread(self.changed):
            logger.warning("unloading %s (%s): its file changed while mapped (%s)", resident.id, resident.model, how)
            await self.remove(resident, f"the model file changed while mapped ({how})")
            gone.append(resident.id)
        return gone

    async def _watch_files(self) -> None:
        while True:
            await asyncio.sleep(self.file_check_interval_s)
            try:
                await self.check_files()
            except Exception:  # a check must never stop the checking
                logger.exception("checking the files of resident models failed")

    async def close(self) -> None:
        """Stop the checks and timers and free every model."""
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        for resident in list(self.models.values()):
            await self.remove(resident, "the service shut down")
        if self._freeing:
            await asyncio.gather(*self._freeing, return_exceptions=True)
