"""Load jobs: a load runs in the background as an asyncio task whose state, progress and
result the API reads; loaded models stay resident until unloaded.

Submitting is where requests are refused: the model path is resolved inside the models
directory, the header read and the placement planned on a bounded pool of threads
(:mod:`.offload`), a big-endian file refused, the number of waiting loads bounded, and
the plan's memory reserved on every device beside the loads and models already admitted
(:mod:`.admission`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import secrets
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

import aiofiles.os

from service.api.admission import Reservations, metadata_nbytes, plan_needs
from service.api.encode import plan_json
from service.api.errors import public_error
from service.api.events import EventHub
from service.api.offload import Offloader, Watch
from service.cancel import CancelToken
from service.errors import (
    BusyError,
    ConflictError,
    GoneError,
    HoistError,
    ModelLimitError,
    ModelPathError,
    NotFoundError,
    RequestError,
    clip,
)
from service.loader.devices import Device
from service.loader.gguf import HeaderLimits
from service.loader.model import LoadedModel, MemoryReport
from service.loader.pipeline import LoadOptions, Progress, check_loadable, load_plan, staging_nbytes
from service.loader.placement import MemorySnapshot, PlacementParams, Plan, make_params, plan
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


def plan_summary(plan: Plan) -> dict[str, Any]:
    """What a job shows of its plan; the whole plan is at ``/v1/loads/{id}/plan``."""
    return {
        "effective_load_mode": plan.effective_load_mode.value,
        "n_layer": plan.n_layer,
        "n_gpu_layers": plan.n_gpu_layers,
        "devices": list(plan.devices),
        "fits": plan.fits,
        "lines": plan.lines(),
    }


@dataclass(eq=False)
class LoadJob:
    """One load job.

    Attributes:
        id: the job id (``lj_...``); a model it loads is registered under the same id.
        model: the model path as requested, relative to the models directory.
        path: the resolved file path.
        params: the placement flags.
        plan: the placement, as planned when the job was submitted (and loaded); None once
            the job ended and no model of it is resident (a plan can be large).
        plan_summary: what the job shows of its plan (kept when the plan is dropped).
        state: the current :class:`JobState`.
        bytes_done: tensor bytes in memory so far.
        bytes_total: tensor bytes the load brings in.
        cancel_requested: True once a cancel was asked for a running job.
        error: the failure as ``HoistError.to_dict()`` data, once failed.
        report: the memory report, once succeeded.
        version: increases whenever anything but the byte counts changes (views of the
            job are cached by it).
    """

    id: str
    model: str
    path: str
    params: PlacementParams
    plan: Plan | None
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
    version: int = 0
    task: asyncio.Task[None] | None = field(default=None, repr=False)
    view: Any = field(default=None, repr=False)
    plan_summary: dict[str, Any] = field(default_factory=dict)
    memory_summary: dict[str, Any] | None = None
    load_mode: str = ""

    def __post_init__(self) -> None:
        if self.plan is not None:
            self.plan_summary = plan_summary(self.plan)
            self.load_mode = self.plan.effective_load_mode.value

    def transition(self, new: JobState) -> None:
        """Move to ``new``. Raises RuntimeError naming the allowed states otherwise."""
        allowed = _NEXT.get(self.state, frozenset())
        if new not in allowed:
            expected = ", ".join(sorted(s.value for s in allowed)) or "nothing (terminal)"
            raise RuntimeError(f"job {self.id}: expected a move to {expected}, got {new.value}")
        self.state = new
        self.version += 1
        if new is JobState.RUNNING:
            self.started_at = _now()
        elif new.terminal:
            self.finished_at = _now()

    @property
    def progress(self) -> float:
        """Fraction of bytes done, 0..1."""
        return self.bytes_done / self.bytes_total if self.bytes_total else float(self.state.terminal)


@dataclass(eq=False)
class ResidentModel:
    """A model loaded by a job and held until unloaded.

    Attributes:
        by_device: bytes it holds per device and buffer type (computed once: a split
            model mapped has a buffer per split).
    """

    id: str
    model: str
    loaded: LoadedModel
    loaded_at: datetime = field(default_factory=_now)
    by_device: dict[str, dict[str, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.by_device = self.loaded.report.by_device()


@dataclass(frozen=True, slots=True)
class Limits:
    """What the job manager admits (see :class:`~service.api.settings.Settings`)."""

    max_concurrent_loads: int = 1
    max_queued_loads: int = 8
    max_resident_models: int = 64
    job_history: int = 256
    request_workers: int = 4
    max_waiting_requests: int = 32
    request_timeout_s: float = 30.0
    override_budget_s: float = 1.0
    file_check_interval_s: float = 2.0
    header_limits: HeaderLimits = field(default_factory=HeaderLimits)
    load_timeout_s: float = 0.0
    descriptors_kept: int = 0
    """File descriptors loads may not use (the connections' share)."""


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
        limits: what is admitted (waiting loads, request threads, time limits, ...).
    """

    def __init__(self, models_dir: str, devices: list[Device], limits: Limits | None = None) -> None:
        self.models_dir = models_dir
        self.devices = devices
        self.limits = limits or Limits()
        self.jobs: dict[str, LoadJob] = {}
        self.models: dict[str, ResidentModel] = {}
        self.reservations = Reservations(devices, descriptors_kept=self.limits.descriptors_kept)
        self.offloader = Offloader(
            self.limits.request_workers, self.limits.max_waiting_requests, self.limits.request_timeout_s
        )
        self._slots = asyncio.Semaphore(self.limits.max_concurrent_loads)
        self._counter = itertools.count(1)
        self._watcher: asyncio.Task[None] | None = None
        self.events = EventHub(models_dir)

    def _new_id(self) -> str:
        return f"lj_{next(self._counter):04d}{secrets.token_hex(4)}"

    def start(self) -> None:
        """Start the background check of resident models' mapped files (on the event
        loop that serves the jobs)."""
        if self._watcher is None and self.limits.file_check_interval_s > 0:
            self._watcher = asyncio.create_task(self._watch_files(), name="hoist file check")

    def params(self, flags: dict[str, Any]) -> PlacementParams:
        """Placement parameters from request flags (``-ot`` names checked against the
        devices' buffer types). Raises RequestError or PlacementError."""
        return make_params([d.default_buffer_type.name for d in self.devices], **flags)

    async def plan_model(
        self, model: str, flags: dict[str, Any], *, watch: Watch | None = None
    ) -> tuple[WeightIndex, PlacementParams, Plan]:
        """Parse ``model`` and plan its placement with ``flags`` (a dry run), on the
        request threads, within the request time limit; stops when ``watch`` returns
        (the client went away).

        Raises:
            RequestError, ModelPathError: bad model path or flags.
            FormatError, SplitError, StorageError: not a valid, readable GGUF model.
            PlacementError: the flags give no valid placement.
            BusyError: too many requests wait for a thread.
            WorkLimitError: the work took longer than the request time limit, or the
                overrides longer than their budget.
            RequestAbandonedError: ``watch`` returned first.
        """
        path = await resolve_model_path(self.models_dir, model)

        def work(token: CancelToken) -> tuple[WeightIndex, PlacementParams, Plan]:
            index = open_model(path, root=self.models_dir, cancel=token, limits=self.limits.header_limits)
            params = self.params(flags)
            memory = MemorySnapshot.take(self.devices)
            placement = plan(
                index, self.devices, params, memory=memory, cancel=token, match_budget_s=self.limits.override_budget_s
            )
            return index, params, placement

        return await self.offloader.run(work, what=f"planning '{clip(model, 200)}'", watch=watch)

    async def plan_json(
        self, model: str, flags: dict[str, Any], *, tensors: bool = True, watch: Watch | None = None
    ) -> bytes:
        """:meth:`plan_model` and the plan encoded as JSON (:func:`~service.api.encode.plan_json`),
        all on the request threads. Raises as :meth:`plan_model`."""
        _, _, placement = await self.plan_model(model, flags, watch=watch)
        return await self.offloader.run(
            lambda token: plan_json(placement, model, self.models_dir, tensors=tensors, cancel=token),
            what=f"encoding the plan of '{clip(model, 200)}'",
            watch=watch,
        )

    async def job_plan_json(self, job_id: str, *, tensors: bool = True, watch: Watch | None = None) -> bytes:
        """The whole plan of job ``job_id`` as JSON, encoded on the request threads.

        Raises:
            NotFoundError: no such job.
            GoneError: the job ended and its model is not resident: its plan is not kept.
        """
        job = self.get(job_id)
        placement = job.plan
        if placement is None:
            raise GoneError(
                f"the plan of load job '{job_id}' is not kept: the job ended and no model of it is resident",
                hint="POST /v1/plans with the same body plans it again",
            )
        return await self.offloader.run(
            lambda token: plan_json(placement, job.model, self.models_dir, tensors=tensors, cancel=token),
            what=f"encoding the plan of load job '{job_id}'",
            watch=watch,
        )

    def _queued(self) -> int:
        return sum(1 for j in self.jobs.values() if j.state is JobState.QUEUED)

    def _check_queue(self) -> None:
        queued = self._queued()
        if queued >= self.limits.max_queued_loads + self._free_slots():
            raise BusyError(
                f"{queued} loads are queued already (at most {self.limits.max_queued_loads}); try again later",
                retry_after=5,
            )

    def _check_models(self) -> None:
        """Refuse a load when the resident models and the loads that will add one (queued
        or running) are at ``max_resident_models``: each resident model costs a little
        host memory whatever its size, and every listing and file check walks them."""
        loading = sum(1 for j in self.jobs.values() if not j.state.terminal)
        held = len(self.models) + loading
        if held >= self.limits.max_resident_models:
            raise ModelLimitError(
                f"{len(self.models)} models are resident and {loading} loads queued or running "
                f"(at most {self.limits.max_resident_models} models in all)",
                hint="unload a model (DELETE /v1/models/{id}) or cancel a load first",
            )

    def _free_slots(self) -> int:
        running = sum(1 for j in self.jobs.values() if j.state is JobState.RUNNING)
        return max(self.limits.max_concurrent_loads - running, 0)

    async def submit(
        self, model: str, flags: dict[str, Any], options: LoadOptions | None = None, *, watch: Watch | None = None
    ) -> LoadJob:
        """Validate ``model`` and the placement flags, plan, reserve memory, and start
        loading in the background.

        Raises:
            BusyError: the queue of waiting loads is full, or too many requests wait.
            ModelLimitError: as many models are resident or loading as the service holds.
            RequestError, ModelPathError: bad model path or flags.
            FormatError, SplitError, StorageError: not a valid, readable GGUF model.
            ByteOrderError: a big-endian file.
            PlacementError: the flags give no valid placement.
            BudgetExceededError: the plan does not fit beside the loads and models
                already admitted.
            WorkLimitError, RequestAbandonedError: as :meth:`plan_model`.
        """
        options = options or LoadOptions()
        self._check_queue()
        self._check_models()
        index, params, placement = await self.plan_model(model, flags, watch=watch)
        check_loadable(index)
        self._check_queue()
        self._check_models()
        job = LoadJob(
            id=self._new_id(),
            model=model,
            path=index.path,
            params=params,
            plan=placement,
            n_tensors=len(index),
            bytes_total=sum(t.nbytes for t in placement.tensors),
            options=options,
            warnings=list(placement.warnings),
        )
        staging = staging_nbytes(placement, self.devices, options)
        # the worker holds each file open, twice when it also validates what it reads
        open_files = len(index.files) * (2 if options.check_tensors else 1)
        needs = plan_needs(placement, staging, options.staging_buffers if staging else 0, open_files)
        self.reservations.reserve(job.id, needs, model=model, metadata=metadata_nbytes(index))
        self.jobs[job.id] = job
        job.task = asyncio.create_task(self._run(job, index), name=f"load {job.id}")
        job.task.add_done_callback(lambda _: self._finished(job))
        self._prune()
        return job

    def _finished(self, job: LoadJob) -> None:
        # a finished task keeps its frames (and what they referenced) through its result
        # or exception; the job keeps only what it reports
        job.task = None
        if job.id not in self.models:
            self.reservations.release(job.id)
            job.plan = None

    def _prune(self) -> None:
        """Forget the oldest ended jobs beyond ``job_history``."""
        ended = [j for j in self.jobs.values() if j.state.terminal]
        for job in ended[: max(0, len(ended) - self.limits.job_history)]:
            del self.jobs[job.id]

    def get(self, job_id: str) -> LoadJob:
        """The job ``job_id``. Raises NotFoundError."""
        job = self.jobs.get(job_id)
        if job is None:
            raise NotFoundError(f"no load job '{clip(job_id, 100)}'")
        return job

    def _fail(self, job: LoadJob, error: dict[str, Any]) -> None:
        job.error = error
        job.transition(JobState.FAILED)
        self.events.publish(job, "error")

    async def _run(self, job: LoadJob, index: WeightIndex) -> None:
        async with self._slots:
            if job.state is not JobState.QUEUED:
                return
            job.transition(JobState.RUNNING)
            self.events.publish(job, "state")

            def on_progress(p: Progress) -> None:
                job.bytes_done = p.bytes_done
                job.bytes_total = p.bytes_total
                self.events.publish(job, "progress", by_device=p.by_device)

            assert job.plan is not None
            limit = self.limits.load_timeout_s or None
            try:
                async with asyncio.timeout(limit):
                    loaded = await load_plan(
                        index, job.plan, self.devices, options=job.options, on_progress=on_progress
                    )
            except TimeoutError:
                message = f"the load took longer than the limit of {limit:g} s and was stopped"
                self._fail(job, {"code": "work_limit_exceeded", "message": message})
                logger.warning("load %s of %s: %s", job.id, job.model, message)
                return
            except asyncio.CancelledError:
                job.transition(JobState.CANCELLED)
                self.events.publish(job, "state")
                raise
            except HoistError as exc:
                self._fail(job, public_error(exc, self.models_dir))
                logger.warning("load %s of %s failed: %s", job.id, job.model, exc)
                return
            except MemoryError:
                self._fail(job, {"code": "out_of_memory", "message": "the host ran out of memory during the load"})
                logger.error("load %s of %s ran out of host memory", job.id, job.model)
                return
            except Exception as exc:
                self._fail(job, {"code": "internal_error", "message": f"internal error ({type(exc).__name__})"})
                logger.exception("load %s of %s failed unexpectedly", job.id, job.model)
                return
            resident = self.models[job.id] = ResidentModel(job.id, job.model, loaded)
            # the staging buffers are gone: the model keeps what its buffers hold
            self.reservations.replace(job.id, plan_needs(loaded.plan))
            job.report = loaded.report
            job.memory_summary = {
                "by_device": resident.by_device,
                "total_bytes": loaded.report.total_nbytes,
                "n_buffers": len(loaded.report.buffers),
            }
            job.warnings = list(loaded.warnings)
            for warning in loaded.warnings:
                if warning not in loaded.plan.warnings:  # those were answered with the plan
                    logger.warning("load %s of %s: %s", job.id, job.model, warning)
                    self.events.publish(job, "warning", warning=warning)
            job.stats = loaded.stats.to_dict()
            job.transition(JobState.SUCCEEDED)
            self.events.publish(job, "report")
            logger.info("loaded %s as %s (%d bytes)", job.model, job.id, loaded.report.total_nbytes)

    def cancel(self, job_id: str) -> LoadJob:
        """Cancel a queued or running job; it ends ``cancelled`` once its load has released
        everything. Raises NotFoundError, or ConflictError for a finished job."""
        job = self.get(job_id)
        if job.state.terminal:
            raise ConflictError(f"load job '{job_id}' already ended as {job.state.value}")
        if job.state is JobState.QUEUED:
            job.transition(JobState.CANCELLED)
            self.events.publish(job, "state")
            self.reservations.release(job.id)
            job.plan = None
        job.cancel_requested = True
        job.version += 1
        if job.task is not None:
            job.task.cancel()
        return job

    def get_model(self, model_id: str) -> ResidentModel:
        """The loaded model ``model_id``. Raises NotFoundError."""
        resident = self.models.get(model_id)
        if resident is None:
            raise NotFoundError(f"no loaded model '{clip(model_id, 100)}'")
        return resident

    def unload(self, model_id: str) -> ResidentModel:
        """Release the model ``model_id``. Raises NotFoundError."""
        resident = self.get_model(model_id)
        del self.models[model_id]
        self.reservations.release(model_id)
        resident.loaded.close()
        job = self.jobs.get(model_id)
        if job is not None:
            # an ended job keeps summaries: its plan and report can be large
            job.plan = None
            job.report = None
            job.version += 1
        return resident

    def check_files(self) -> list[str]:
        """Unload every resident model whose mapped files changed (shrank or were
        rewritten) since they were mapped; returns their ids. Nothing in the service
        reads a model's pages afterwards, so a shrunk file cannot raise SIGBUS here."""
        gone = []
        for model_id, resident in list(self.models.items()):
            changed = resident.loaded.changed_files()
            if not changed:
                continue
            how = "; ".join(f"{os.path.relpath(path, self.models_dir)}: {what}" for path, what in changed)
            logger.warning("unloading %s (%s): its file changed while mapped (%s)", model_id, resident.model, how)
            self.unload(model_id)
            job = self.jobs.get(model_id)
            if job is not None:
                job.warnings.append(f"unloaded: the model file changed while mapped ({how})")
                job.version += 1
            gone.append(model_id)
        return gone

    async def _watch_files(self) -> None:
        while True:
            await asyncio.sleep(self.limits.file_check_interval_s)
            try:
                self.check_files()
            except Exception:  # a check must never stop the checking
                logger.exception("checking the files of resident models failed")

    async def close(self) -> None:
        """Stop request work, cancel every job, wait for them, and release every model."""
        self.offloader.close()
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        tasks = [job.task for job in self.jobs.values() if job.task is not None and not job.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for model_id in list(self.models):
            self.unload(model_id)
