"""The job manager: where load requests are admitted, and what ties the job runner
(:mod:`.runner`) to the model registry (:mod:`.registry`).

Submitting is where requests are refused: the model path is resolved inside the models
directory, the header read and the placement planned once on a bounded pool of threads
(:mod:`.offload`), a big-endian file refused, the name checked, the number of waiting
loads bounded, and the plan's memory reserved on every device beside the loads and
models already admitted (:mod:`.admission`), least-recently-used models evicted first
when the service is set to. A load of a model resident under the same name (or any
name, when none is given) with the same files and resolved placement shares it instead.
The load runs the plan made here.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiofiles.os

from service.api.admission import Reservations, metadata_nbytes, plan_needs
from service.api.callback_policy import AllowList
from service.api.callbacks import Callbacks
from service.api.catalog import Summaries
from service.api.encode import plan_json
from service.api.errors import public_error, scrub_paths
from service.api.events import EventHub
from service.api.keepalive import FOREVER
from service.api.offload import Offloader, Watch
from service.api.registry import LoadInProgressError, ModelRegistry, NameTakenError, ResidentModel
from service.api.runner import JobRunner, JobState, LoadJob, plan_summary
from service.api.spec import LoadSpec, PlacementFlags, ShareKey, check_name, share_key
from service.cancel import CancelToken
from service.errors import (
    BudgetExceededError,
    GoneError,
    HoistError,
    ModelLimitError,
    ModelPathError,
    RequestError,
    clip,
)
from service.loader.gguf import HeaderLimits

if TYPE_CHECKING:  # the loader is imported with the first plan, not at start
    from service.loader.devices import Device
    from service.loader.model import LoadedModel
    from service.loader.placement import PlacementParams, Plan
    from service.loader.weights import WeightIndex

__all__ = [
    "JobManager",
    "JobState",
    "Limits",
    "LoadJob",
    "LoadSpec",
    "PlacementFlags",
    "ResidentModel",
    "plan_summary",
    "resolve_model_path",
]

logger = logging.getLogger(__name__)


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
    keep_alive_s: float = FOREVER
    """Keep-alive of a load that gives none (seconds; negative: until unloaded)."""
    evict_idle: bool = False
    """Unload least-recently-used models to make room for a load that would not fit."""
    callback_hosts: str = ""
    """Hosts and networks callbacks may be sent to (empty: callbacks refused)."""
    callback_secret: str | None = field(default=None, repr=False)
    """Key that signs callback requests (None: unsigned)."""
    callback_timeout_s: float = 5.0
    """Connect and read time limit of one callback attempt, in seconds."""
    callback_retry_s: float = 60.0
    """How long a job's final event is retried, in seconds."""


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


@dataclass(frozen=True, slots=True)
class Planned:
    """A load request planned once, at submit: what its load runs.

    Attributes:
        index: the parsed model.
        params: the resolved placement flags.
        plan: the placement.
        capacities: each device's memory capacity for hoist when it was planned
            (:meth:`~service.api.admission.Reservations.capacities`).
    """

    index: WeightIndex
    params: PlacementParams
    plan: Plan
    capacities: dict[str, tuple[int, int] | None]


@dataclass(eq=False)
class Preload:
    """A model the service loads as it starts (``HOIST_PRELOAD``).

    Attributes:
        spec: the load.
        name: the name it is to be resident under.
        job_id: its load job, once submitted.
        error: why it could not be submitted (``code``, ``message``), if so.
    """

    spec: LoadSpec
    name: str
    job_id: str | None = None
    error: dict[str, Any] | None = None


def _memory_summary(resident: ResidentModel) -> dict[str, Any]:
    report = resident.loaded.report
    return {"by_device": resident.by_device, "total_bytes": report.total_nbytes, "n_buffers": len(report.buffers)}


class JobManager:
    """Admits loads, runs them (:class:`~service.api.runner.JobRunner`) and holds the
    models they load (:class:`~service.api.registry.ModelRegistry`).

    Args:
        models_dir: request paths are relative to it.
        devices: the devices models are placed on.
        limits: what is admitted (waiting loads, request threads, time limits, ...).
    """

    def __init__(self, models_dir: str, devices: list[Device], limits: Limits | None = None) -> None:
        self.models_dir = models_dir
        self.devices = devices
        self.limits = limits or Limits()
        self.reservations = Reservations(devices, descriptors_kept=self.limits.descriptors_kept)
        self.offloader = Offloader(
            self.limits.request_workers, self.limits.max_waiting_requests, self.limits.request_timeout_s
        )
        self.registry = ModelRegistry(self.reservations, models_dir, self._freed, self.limits.file_check_interval_s)
        self.runner = JobRunner(
            devices,
            self.reservations,
            models_dir,
            on_loaded=self._loaded,
            is_resident=lambda job_id: job_id in self.registry.models,
            on_forget=self.registry.forget_job,
            max_concurrent_loads=self.limits.max_concurrent_loads,
            max_queued_loads=self.limits.max_queued_loads,
            job_history=self.limits.job_history,
            load_timeout_s=self.limits.load_timeout_s,
        )
        self.catalog = Summaries(models_dir, self.limits.header_limits)
        self.callbacks = Callbacks(
            self.runner.events,
            AllowList(self.limits.callback_hosts),
            secret=self.limits.callback_secret,
            timeout_s=self.limits.callback_timeout_s,
            final_retry_s=self.limits.callback_retry_s,
        )
        self.preloads: list[Preload] = []
        self._admission = asyncio.Lock()
        self._preloading: asyncio.Task[None] | None = None

    @property
    def events(self) -> EventHub:
        """The live events of every job."""
        return self.runner.events

    @property
    def jobs(self) -> dict[str, LoadJob]:
        """Load jobs by id, oldest first."""
        return self.runner.jobs

    @property
    def models(self) -> dict[str, ResidentModel]:
        """Resident models by id, oldest first."""
        return self.registry.models

    def start(self) -> None:
        """Start the background check of resident models' mapped files (on the event
        loop that serves the jobs)."""
        self.registry.start()

    # -- planning -----------------------------------------------------------------

    def params(self, flags: PlacementFlags) -> PlacementParams:
        """Placement parameters from request flags (``-ot`` names checked against the
        devices' buffer types). Raises RequestError or PlacementError."""
        return flags.params([d.default_buffer_type.name for d in self.devices])

    async def plan_model(
        self, model: str, flags: PlacementFlags, *, watch: Watch | None = None, capacities: bool = False
    ) -> Planned:
        """Parse ``model`` and plan its placement with ``flags`` (a dry run), on the
        request threads, within the request time limit; stops when ``watch`` returns
        (the client went away). ``capacities``: also read the devices' capacities for
        admission (empty otherwise).

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

        def work(token: CancelToken) -> Planned:
            from service.loader.placement import MemorySnapshot, plan
            from service.loader.weights import open_model

            index = open_model(path, root=self.models_dir, cancel=token, limits=self.limits.header_limits)
            params = self.params(flags)
            memory = MemorySnapshot.take(self.devices)
            placement = plan(
                index, self.devices, params, memory=memory, cancel=token, match_budget_s=self.limits.override_budget_s
            )
            return Planned(index, params, placement, self.reservations.capacities() if capacities else {})

        return await self.offloader.run(work, what=f"planning '{clip(model, 200)}'", watch=watch)

    async def plan_json(
        self, model: str, flags: PlacementFlags, *, tensors: bool = True, watch: Watch | None = None
    ) -> bytes:
        """:meth:`plan_model` and the plan encoded as JSON (:func:`~service.api.encode.plan_json`),
        all on the request threads. Raises as :meth:`plan_model`."""
        placement = (await self.plan_model(model, flags, watch=watch)).plan
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
                f"the plan of load job '{job_id}' is not kept: the job ended and no model of it is resident"
                + (" (it shared a resident model: see the plan of the job that loaded it)" if job.shared else ""),
                hint="POST /v1/plans with the same body plans it again",
            )
        return await self.offloader.run(
            lambda token: plan_json(placement, job.model, self.models_dir, tensors=tensors, cancel=token),
            what=f"encoding the plan of load job '{job_id}'",
            watch=watch,
        )

    async def list_files(self, offset: int, limit: int, *, watch: Watch | None = None) -> dict[str, Any]:
        """A page of the model files under the models directory with their summaries
        (:mod:`.catalog`), walked and parsed on the request threads. Raises BusyError,
        WorkLimitError or RequestAbandonedError as :meth:`plan_model`."""
        page = await self.offloader.run(
            lambda token: self.catalog.page(offset, limit, token), what="listing the model files", watch=watch
        )
        out: dict[str, Any] = scrub_paths(page, self.models_dir)
        return out

    # -- jobs and models ----------------------------------------------------------

    def get(self, job_id: str) -> LoadJob:
        """The job ``job_id``. Raises NotFoundError."""
        return self.runner.get(job_id)

    def cancel(self, job_id: str) -> LoadJob:
        """Cancel a queued or running job (see :meth:`JobRunner.cancel`)."""
        return self.runner.cancel(job_id)

    def get_model(self, ref: str) -> ResidentModel:
        """The resident model whose id, name or load job id is ``ref``. Raises NotFoundError."""
        return self.registry.find(ref)

    async def unload(self, ref: str) -> tuple[ResidentModel, bool]:
        """Drop one reference of the model ``ref`` (id, name or load job id); the last one
        frees it. Returns the model and whether it was freed. Raises NotFoundError."""
        return await self.registry.release(ref)

    def loading(self, name: str) -> LoadJob | None:
        """The queued or running job that loads a model under ``name``, if any."""
        return next((j for j in self.runner.active() if j.name == name), None)

    def _check_models(self) -> None:
        """Refuse a load when the resident models and the loads that will add one (queued
        or running) are at ``max_resident_models``: each resident model costs a little
        host memory whatever its size, and every listing and file check walks them."""
        loading = len(self.runner.active())
        held = len(self.models) + loading
        if held >= self.limits.max_resident_models:
            raise ModelLimitError(
                f"{len(self.models)} models are resident and {loading} loads queued or running "
                f"(at most {self.limits.max_resident_models} models in all)",
                hint="unload a model (DELETE /v1/models/{name}) or cancel a load first",
            )

    def _check_name(self, name: str, key: ShareKey, checked: bool, hashed: bool = False) -> None:
        """Refuse a name held by a resident model this load cannot share, or by a load in
        progress."""
        holder = self.registry.by_name.get(name)
        if holder is not None:
            if holder.key == key and checked and not holder.checked:
                why = "was loaded without check_tensors (a load that checks its data does not share it)"
            elif holder.key == key and hashed and not holder.hashed:
                why = "was loaded without hash_tensors (a load that hashes its data does not share it)"
            else:
                why = f"was loaded from '{holder.model}' with other files or another placement"
            raise NameTakenError(
                f"the name '{name}' is taken: model {holder.id} {why}",
                hint="give the load another 'name', or unload that model first",
            )
        job = self.loading(name)
        if job is None:
            return
        if job.key == key:
            raise LoadInProgressError(
                f"model '{name}' is being loaded by job {job.id} ({job.state.value})",
                hint=f"wait for /v1/loads/{job.id} to succeed and load again to share it, or give another 'name'",
            )
        raise NameTakenError(
            f"the name '{name}' is taken by load job {job.id} of '{job.model}' with other files or another placement",
            hint="give the load another 'name'",
        )

    async def submit(self, spec: LoadSpec, *, watch: Watch | None = None) -> LoadJob:
        """Validate the request, plan it (once: the load runs this plan), and either share
        a resident model or reserve memory and start loading in the background.

        Raises:
            BusyError: the queue of waiting loads is full, or too many requests wait.
            ModelLimitError: as many models are resident or loading as the service holds.
            RequestError, ModelPathError: bad model path, name or flags.
            NameTakenError: the name is held by another model or load.
            LoadInProgressError: the same model is being loaded under that name.
            FormatError, SplitError, StorageError: not a valid, readable GGUF model.
            ByteOrderError: a big-endian file.
            PlacementError: the flags give no valid placement.
            BudgetExceededError: the plan does not fit beside the loads and models
                already admitted (after evicting idle models, when that is on).
            WorkLimitError, RequestAbandonedError: as :meth:`plan_model`.
            CallbackRefusedError: the callback URL is not allowed (or callbacks are off).
        """
        if spec.name is not None:
            check_name(spec.name)
        if spec.callback is not None:
            self.callbacks.check(spec.callback)
        keep_alive = self.limits.keep_alive_s if spec.keep_alive_s is None else spec.keep_alive_s
        if (spec.name or spec.model) not in self.registry.by_name:
            # refused before the planning work when nothing resident could be shared
            self.runner.check_queue()
            self._check_models()
        from service.loader.pipeline import check_loadable, staging_nbytes

        planned = await self.plan_model(spec.model, spec.flags, watch=watch, capacities=True)
        check_loadable(planned.index)
        key = share_key(planned.index, planned.params, planned.plan)
        async with self._admission:
            resident = self.registry.shareable(
                spec.name, key, checked=spec.options.check_tensors, hashed=spec.options.hash_tensors
            )
            if resident is not None:
                job = self._share(resident, spec, planned, keep_alive)
                if spec.callback is not None:
                    self.callbacks.start(job, spec.callback)
                return job
            name = spec.name if spec.name is not None else check_name(spec.model, what="default name")
            self._check_name(name, key, spec.options.check_tensors, spec.options.hash_tensors)
            self.runner.check_queue()
            self._check_models()
            index, placement = planned.index, planned.plan
            job = LoadJob(
                id=self.runner.new_id(),
                model=spec.model,
                path=index.path,
                params=planned.params,
                plan=placement,
                n_tensors=len(index),
                bytes_total=sum(t.nbytes for t in placement.tensors),
                options=spec.options,
                warnings=list(placement.warnings),
                name=name,
                keep_alive_s=keep_alive,
                key=key,
            )
            staging = staging_nbytes(placement, self.devices, spec.options)
            # the worker holds each file open, twice when it also validates or hashes what it reads
            twice = spec.options.check_tensors or spec.options.hash_tensors
            open_files = len(index.files) * (2 if twice else 1)
            needs = plan_needs(placement, staging, spec.options.staging_buffers if staging else 0, open_files)
            evicted = await self._admit(job, needs, metadata_nbytes(index), planned.capacities)
            for resident in evicted:
                job.note(
                    f"evicted the idle model '{resident.name}' ({resident.id}, "
                    f"{resident.loaded.report.total_nbytes} bytes) to make room"
                )
            if spec.callback is not None:
                # started first: it follows the job from its first event
                self.callbacks.start(job, spec.callback)
            self.runner.start(job, index)
            return job

    def _share(self, resident: ResidentModel, spec: LoadSpec, planned: Planned, keep_alive: float) -> LoadJob:
        """A job that ends at once, sharing ``resident`` (one more reference; its
        keep-alive restarts with this one). Nothing is reserved: the model's memory is."""
        job = LoadJob(
            id=self.runner.new_id(),
            model=spec.model,
            path=planned.index.path,
            params=planned.params,
            plan=planned.plan,
            n_tensors=len(planned.index),
            bytes_total=0,
            options=spec.options,
            name=resident.name,
            keep_alive_s=keep_alive,
            shared=True,
            model_id=resident.id,
        )
        job.plan = None  # the resident model's own job keeps the plan
        job.memory_summary = _memory_summary(resident)
        job.transition(JobState.RUNNING)
        job.transition(JobState.SUCCEEDED)
        self.registry.attach(resident, job.id, keep_alive)
        self.runner.record(job)
        logger.info("load %s shares %s (%s): %d references", job.id, resident.id, resident.name, resident.references)
        return job

    async def _admit(
        self, job: LoadJob, needs: dict[str, int], metadata: int, capacities: dict[str, tuple[int, int] | None]
    ) -> list[ResidentModel]:
        """Reserve ``needs`` for ``job``; when it does not fit and eviction is on, unload
        the fewest least-recently-used resident models that make it fit first. Returns
        those unloaded. Raises BudgetExceededError (nothing unloaded then)."""
        try:
            self.reservations.reserve(job.id, needs, model=job.model, metadata=metadata, capacities=capacities)
            return []
        except BudgetExceededError:
            if not self.limits.evict_idle or not self.registry.models:
                raise
            total = dict(needs)
            total["CPU"] = total.get("CPU", 0) + metadata
            caps = dict(capacities)
            if caps.get("CPU") is not None:
                capacity, free = caps["CPU"]  # type: ignore[misc]
                caps["CPU"] = (capacity + metadata, free)

            def fits(unloaded: set[str]) -> bool:
                return not self.reservations.shortfalls(job.id, total, capacities=caps, excluding=unloaded)

            victims = self.registry.victims(fits)
            if victims is None:
                raise
        for resident in victims:
            logger.info(
                "evicting %s (%s) to make room for load %s of %s", resident.name, resident.id, job.id, job.model
            )
            await self.registry.remove(resident, f"evicted (least recently used) to make room for load {job.id}")
        self.reservations.reserve(job.id, needs, model=job.model, metadata=metadata, capacities=capacities)
        return victims

    def _loaded(self, job: LoadJob, loaded: LoadedModel) -> None:
        resident = ResidentModel(
            job.id,
            job.name,
            job.model,
            loaded,
            key=job.key,
            checked=job.options.check_tensors,
            hashed=job.options.hash_tensors,
            keep_alive_s=job.keep_alive_s,
        )
        # the staging buffers are gone: the model keeps what its buffers hold
        self.reservations.replace(job.id, plan_needs(loaded.plan))
        job.memory_summary = _memory_summary(resident)
        self.registry.add(resident)

    def _freed(self, resident: ResidentModel, reason: str) -> None:
        job = self.runner.jobs.get(resident.id)
        if job is None:
            return
        # an ended job keeps summaries: its plan and report can be large
        job.plan = None
        job.report = None
        job.version += 1
        if reason != "unloaded":
            job.note(f"unloaded: {reason}")

    # -- preloading and readiness -------------------------------------------------

    def preload(self, specs: Sequence[LoadSpec]) -> None:
        """Load ``specs`` one after another in the background (the service answers
        meanwhile), each submitted once the one before ended; :meth:`readiness` tells
        when their models are resident."""
        self.preloads = [Preload(spec, spec.name or spec.model) for spec in specs]
        if self.preloads:
            self._preloading = asyncio.create_task(self._preload(), name="hoist preload")

    async def _preload(self) -> None:
        for item in self.preloads:
            try:
                job = await self.submit(item.spec)
            except HoistError as exc:
                item.error = public_error(exc, self.models_dir)
                logger.error("preloading %s failed: %s", item.spec.model, item.error["message"])
                continue
            item.job_id = job.id
            # one at a time: the next is admitted beside this one's model, not its load
            if job.task is not None:
                await asyncio.gather(job.task, return_exceptions=True)

    def readiness(self) -> tuple[list[str], list[dict[str, Any]], list[dict[str, Any]]]:
        """(names resident, names pending with their job, names failed with the error)
        of the preloaded models. A preloaded model unloaded since is pending again
        (without a job)."""
        ready: list[str] = []
        pending: list[dict[str, Any]] = []
        failed: list[dict[str, Any]] = []
        for item in self.preloads:
            if item.name in self.registry.by_name:
                ready.append(item.name)
                continue
            job = self.runner.jobs.get(item.job_id) if item.job_id else None
            if item.error is not None:
                failed.append({"name": item.name, "model": item.spec.model, "error": item.error})
            elif job is not None and job.state in (JobState.FAILED, JobState.CANCELLED):
                error = job.error or {"code": "load_cancelled", "message": "the load was cancelled"}
                failed.append({"name": item.name, "model": item.spec.model, "job_id": job.id, "error": error})
            else:
                state = job.state.value if job is not None and not job.state.terminal else None
                pending.append({"name": item.name, "model": item.spec.model, "job_id": item.job_id, "state": state})
        return ready, pending, failed

    async def close(self) -> None:
        """Stop request work, cancel every job and the preloading, wait for them, and
        release every model."""
        self.offloader.close()
        if self._preloading is not None:
            self._preloading.cancel()
            await asyncio.gather(self._preloading, return_exceptions=True)
        await self.runner.close()
        await self.callbacks.close()
        await self.registry.close()
