"""Load jobs: a load runs in the background as an asyncio task whose state, progress and
result the API reads; loaded models stay resident until unloaded."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import secrets
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

import aiofiles.os

from service.api.errors import public_error
from service.errors import ConflictError, HoistError, ModelPathError, NotFoundError, RequestError
from service.loader.devices import Device
from service.loader.model import LoadedModel, MemoryReport
from service.loader.pipeline import LoadOptions, Progress, check_budget, load_model, staging_nbytes
from service.loader.placement import PlacementParams, Plan, make_params, plan
from service.loader.weights import WeightIndex, open_model

logger = logging.getLogger(__name__)


class JobState(StrEnum):
    """Lifecycle of a load job: ``queued -> running -> succeeded | failed | cancelled``."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        """True for states that never change again."""
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


_NEXT: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.RUNNING, JobState.CANCELLED}),
    JobState.RUNNING: frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}),
}


def _now() -> datetime:
    return datetime.now(UTC)


@dataclass(eq=False)
class LoadJob:
    """One load job.

    Attributes:
        id: the job id (``lj_...``); a model it loads is registered under the same id.
        model: the model path as requested, relative to the models directory.
        path: the resolved file path.
        params: the placement flags.
        plan: the placement, as planned when the job was submitted.
        state: the current :class:`JobState`.
        bytes_done: tensor bytes in memory so far.
        bytes_total: tensor bytes the load brings in.
        cancel_requested: True once a cancel was asked for a running job.
        error: the failure as ``HoistError.to_dict()`` data, once failed.
        report: the memory report, once succeeded.
    """

    id: str
    model: str
    path: str
    params: PlacementParams
    plan: Plan
    n_tensors: int
    bytes_total: int
    options: LoadOptions = field(default_factory=LoadOptions)
    warnings: list[str] = field(default_factory=list)
    stats: dict[str, Any] | None = None
    state: JobState = JobState.QUEUED
    bytes_done: int = 0
    cancel_requested: bool = False
    error: dict[str, Any] | None = None
    report: MemoryReport | None = None
    created_at: datetime = field(default_factory=_now)
    started_at: datetime | None = None
    finished_at: datetime | None = None
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    def transition(self, new: JobState) -> None:
        """Move to ``new``. Raises RuntimeError naming the allowed states otherwise."""
        allowed = _NEXT.get(self.state, frozenset())
        if new not in allowed:
            expected = ", ".join(sorted(s.value for s in allowed)) or "nothing (terminal)"
            raise RuntimeError(f"job {self.id}: expected a move to {expected}, got {new.value}")
        self.state = new
        if new is JobState.RUNNING:
            self.started_at = _now()
        elif new.terminal:
            self.finished_at = _now()

    @property
    def load_mode(self) -> str:
        """The load mode in effect (``auto`` resolved by the plan)."""
        return self.plan.effective_load_mode.value

    @property
    def progress(self) -> float:
        """Fraction of bytes done, 0..1."""
        return self.bytes_done / self.bytes_total if self.bytes_total else float(self.state.terminal)


@dataclass(eq=False)
class ResidentModel:
    """A model loaded by a job and held until unloaded."""

    id: str
    model: str
    loaded: LoadedModel
    loaded_at: datetime = field(default_factory=_now)


MAX_MODEL_PATH = 4096
"""Longest model path a request may give, in bytes (PATH_MAX)."""


async def resolve_model_path(models_dir: str, model: str) -> str:
    """The file that request path ``model`` names inside ``models_dir``, as a path inside
    the models directory (symbolic links inside it are kept, so that split siblings are
    found next to the name given).

    Raises:
        RequestError: the path is empty, too long, absolute, not in normal form, or leaves
            the models directory (through ``..`` or a symbolic link).
        ModelPathError: no such file.
    """
    try:
        encoded = model.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(f"model path {ascii(model[:200])} is not valid UTF-8") from None
    if len(encoded) > MAX_MODEL_PATH or any(len(part) > 255 for part in encoded.split(b"/")):
        raise RequestError(f"model path is too long ({len(encoded)} bytes; at most {MAX_MODEL_PATH}, 255 per name)")
    if not model or os.path.isabs(model) or "\0" in model or model.endswith("/"):
        raise RequestError(f"model path {model!r} must name a file relative to the models directory")
    if os.path.normpath(model) != model:
        raise RequestError(f"model path {model!r} is not in normal form (write {os.path.normpath(model)!r})")

    def inside() -> str:
        root = os.path.realpath(models_dir)
        path = os.path.join(root, model)
        if os.path.commonpath([root, os.path.realpath(path)]) != root:
            raise RequestError(f"model path '{model}' leaves the models directory")
        return path

    path = await asyncio.to_thread(inside)
    if not await aiofiles.os.path.isfile(path):
        raise ModelPathError(f"no model file '{model}' in the models directory")
    return path


class JobManager:
    """Runs load jobs and holds the models they load.

    Args:
        models_dir: request paths are relative to it.
        devices: the devices models are placed on.
        max_concurrent_loads: loads (and header parses) running at once; other loads
            wait as ``queued``.
        job_history: ended jobs kept for ``GET /v1/loads``; older ones are forgotten.
    """

    def __init__(
        self, models_dir: str, devices: list[Device], max_concurrent_loads: int = 1, job_history: int = 256
    ) -> None:
        self.models_dir = models_dir
        self.devices = devices
        self.job_history = job_history
        self.jobs: dict[str, LoadJob] = {}
        self.models: dict[str, ResidentModel] = {}
        self._slots = asyncio.Semaphore(max_concurrent_loads)
        # header parses of submitted models (bounded: a header can be large to parse)
        self._parsing = asyncio.Semaphore(max_concurrent_loads)
        self._counter = itertools.count(1)

    def _new_id(self) -> str:
        return f"lj_{next(self._counter):04d}{secrets.token_hex(4)}"

    async def open(self, model: str) -> WeightIndex:
        """Resolve ``model`` inside the models directory and parse it (and its splits).

        Raises:
            RequestError, ModelPathError: bad model path.
            FormatError, SplitError, StorageError: not a valid, readable GGUF model.
        """
        path = await resolve_model_path(self.models_dir, model)
        async with self._parsing:
            return await asyncio.to_thread(open_model, path, root=self.models_dir)

    def params(self, flags: dict[str, Any]) -> PlacementParams:
        """Placement parameters from request flags (``-ot`` names checked against the
        devices' buffer types). Raises RequestError or PlacementError."""
        return make_params([d.default_buffer_type.name for d in self.devices], **flags)

    async def plan_model(self, model: str, flags: dict[str, Any]) -> tuple[WeightIndex, PlacementParams, Plan]:
        """Parse ``model`` and plan its placement with ``flags`` (a dry run)."""
        index = await self.open(model)
        params = self.params(flags)
        return index, params, await asyncio.to_thread(plan, index, self.devices, params)

    async def submit(self, model: str, flags: dict[str, Any], options: LoadOptions | None = None) -> LoadJob:
        """Validate ``model`` and the placement flags, plan, and start loading in the
        background.

        Raises:
            RequestError, ModelPathError: bad model path or flags.
            FormatError, SplitError, StorageError: not a valid, readable GGUF model.
            PlacementError: the flags give no valid placement.
            BudgetExceededError: the plan does not fit the devices' free memory now.
        """
        index, params, placement = await self.plan_model(model, flags)
        check_budget(placement, staging=staging_nbytes(placement, self.devices, options or LoadOptions()))
        job = LoadJob(
            id=self._new_id(),
            model=model,
            path=index.path,
            params=params,
            plan=placement,
            n_tensors=len(index),
            bytes_total=sum(t.nbytes for t in placement.tensors),
            options=options or LoadOptions(),
            warnings=list(placement.warnings),
        )
        self.jobs[job.id] = job
        job.task = asyncio.create_task(self._run(job, index), name=f"load {job.id}")
        job.task.add_done_callback(lambda _: self._finished(job))
        self._prune()
        return job

    def _finished(self, job: LoadJob) -> None:
        # a finished task keeps its frames (and what they referenced) through its result
        # or exception; the job keeps only what it reports
        job.task = None

    def _prune(self) -> None:
        """Forget the oldest ended jobs beyond ``job_history``."""
        ended = [j for j in self.jobs.values() if j.state.terminal]
        for job in ended[: max(0, len(ended) - self.job_history)]:
            del self.jobs[job.id]

    def get(self, job_id: str) -> LoadJob:
        """The job ``job_id``. Raises NotFoundError."""
        job = self.jobs.get(job_id)
        if job is None:
            raise NotFoundError(f"no load job '{job_id}'")
        return job

    async def _run(self, job: LoadJob, index: WeightIndex) -> None:
        async with self._slots:
            if job.state is not JobState.QUEUED:
                return
            job.transition(JobState.RUNNING)

            def on_progress(p: Progress) -> None:
                job.bytes_done = p.bytes_done
                job.bytes_total = p.bytes_total

            try:
                loaded = await load_model(
                    index, devices=self.devices, params=job.params, options=job.options, on_progress=on_progress
                )
            except asyncio.CancelledError:
                job.transition(JobState.CANCELLED)
                raise
            except HoistError as exc:
                job.error = public_error(exc, self.models_dir)
                job.transition(JobState.FAILED)
                logger.warning("load %s of %s failed: %s", job.id, job.model, exc)
                return
            except Exception as exc:
                job.error = {"code": "internal_error", "message": f"{type(exc).__name__}: {exc}"}
                job.transition(JobState.FAILED)
                logger.exception("load %s of %s failed unexpectedly", job.id, job.model)
                return
            self.models[job.id] = ResidentModel(job.id, job.model, loaded)
            job.plan = loaded.plan
            job.report = loaded.report
            job.warnings = list(loaded.warnings)
            job.stats = loaded.stats.to_dict()
            job.transition(JobState.SUCCEEDED)
            logger.info("loaded %s as %s (%d bytes)", job.model, job.id, loaded.report.total_nbytes)

    def cancel(self, job_id: str) -> LoadJob:
        """Cancel a queued or running job; it ends ``cancelled`` once its load has released
        everything. Raises NotFoundError, or ConflictError for a finished job."""
        job = self.get(job_id)
        if job.state.terminal:
            raise ConflictError(f"load job '{job_id}' already ended as {job.state.value}")
        if job.state is JobState.QUEUED:
            job.transition(JobState.CANCELLED)
        job.cancel_requested = True
        if job.task is not None:
            job.task.cancel()
        return job

    def get_model(self, model_id: str) -> ResidentModel:
        """The loaded model ``model_id``. Raises NotFoundError."""
        resident = self.models.get(model_id)
        if resident is None:
            raise NotFoundError(f"no loaded model '{model_id}'")
        return resident

    def unload(self, model_id: str) -> ResidentModel:
        """Release the model ``model_id``. Raises NotFoundError."""
        resident = self.get_model(model_id)
        del self.models[model_id]
        resident.loaded.close()
        return resident

    async def close(self) -> None:
        """Cancel every job, wait for them, and release every model."""
        tasks = [job.task for job in self.jobs.values() if job.task is not None and not job.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for model_id in list(self.models):
            self.unload(model_id)
