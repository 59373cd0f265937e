"""Load jobs: each load runs in the background as an asyncio task whose state, progress
and result the API reads. The runner owns the queue (a bound on the loads running at
once), the tasks, cancellation and the load time limit; what a load leaves in memory
is handed to the caller (the model registry)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

from service.api.admission import Reservations
from service.api.errors import public_error
from service.api.events import EventHub
from service.errors import BusyError, ConflictError, HoistError, NotFoundError, clip
from service.loader.pipeline.options import LoadOptions
from service.logs import bind_load

if TYPE_CHECKING:  # the loader is imported with the first load, not at start
    from service.loader.devices import Device
    from service.loader.model import LoadedModel, MemoryReport
    from service.loader.pipeline import Progress
    from service.loader.placement import PlacementParams, Plan
    from service.loader.weights import WeightIndex

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
        name: the name the model is hosted under.
        keep_alive_s: the keep-alive the load asked for (seconds; negative: forever).
        shared: True when the load shared a resident model instead of loading one.
        model_id: the id of the model it loaded or shared, once succeeded.
        state: the current :class:`JobState`.
        bytes_done: tensor bytes in memory so far.
        bytes_total: tensor bytes the load brings in (0 for a shared load).
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
    name: str = ""
    keep_alive_s: float = -1.0
    shared: bool = False
    model_id: str | None = None
    key: tuple[Any, ...] = field(default=(), repr=False)
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
    callback: Any = field(default=None, repr=False)
    """The delivery status of the job's callback (:class:`~service.api.callbacks.DeliveryStatus`), if any."""

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

    def note(self, warning: str) -> None:
        """Add a warning to the job's view."""
        self.warnings.append(warning)
        self.version += 1

    @property
    def progress(self) -> float:
        """Fraction of bytes done, 0..1."""
        return self.bytes_done / self.bytes_total if self.bytes_total else float(self.state.terminal)


Loaded = Callable[[LoadJob, "LoadedModel"], None]
"""Called on the event loop with a job whose load succeeded and what it loaded, before
the job moves to ``succeeded``; it takes ownership of the model."""


class LoadObserver(Protocol):
    """What is told of loads as they run (the metrics); called on the event loop."""

    def load_progressed(self, job: LoadJob, nbytes: int) -> None:
        """``nbytes`` more tensor bytes of ``job`` are in memory."""

    def load_ended(self, job: LoadJob) -> None:
        """``job``'s task ended (its state is terminal unless the service is stopping)."""


class JobRunner:
    """Runs load jobs, at most ``max_concurrent_loads`` at once.

    Args:
        devices: the devices models are placed on.
        reservations: each job's reservation is released when it ends without a model.
        models_dir: to name files relative to it in errors.
        on_loaded: takes each loaded model (see :data:`Loaded`).
        is_resident: whether a model of job id is resident (its reservation is then kept).
        on_forget: called with the id of each ended job dropped from the history.
        max_concurrent_loads, max_queued_loads, job_history, load_timeout_s: the limits.
    """

    def __init__(
        self,
        devices: list[Device],
        reservations: Reservations,
        models_dir: str,
        *,
        on_loaded: Loaded,
        is_resident: Callable[[str], bool],
        on_forget: Callable[[str], None],
        max_concurrent_loads: int = 1,
        max_queued_loads: int = 8,
        job_history: int = 256,
        load_timeout_s: float = 0.0,
    ) -> None:
        self.devices = devices
        self.reservations = reservations
        self.models_dir = models_dir
        self.on_loaded = on_loaded
        self.is_resident = is_resident
        self.on_forget = on_forget
        self.max_concurrent_loads = max_concurrent_loads
        self.max_queued_loads = max_queued_loads
        self.job_history = job_history
        self.load_timeout_s = load_timeout_s
        self.jobs: dict[str, LoadJob] = {}
        self._slots = asyncio.Semaphore(max_concurrent_loads)
        self._counter = itertools.count(1)
        self.observer: LoadObserver | None = None
        self.events = EventHub(models_dir)

    def new_id(self) -> str:
        """A fresh job id."""
        return f"lj_{next(self._counter):04d}{secrets.token_hex(4)}"

    def get(self, job_id: str) -> LoadJob:
        """The job ``job_id``. Raises NotFoundError."""
        job = self.jobs.get(job_id)
        if job is None:
            raise NotFoundError(f"no load job '{clip(job_id, 100)}'")
        return job

    def active(self) -> list[LoadJob]:
        """Queued and running jobs."""
        return [j for j in self.jobs.values() if not j.state.terminal]

    def check_queue(self) -> None:
        """Raise BusyError when ``max_queued_loads`` loads wait beyond the free slots."""
        queued = sum(1 for j in self.jobs.values() if j.state is JobState.QUEUED)
        running = sum(1 for j in self.jobs.values() if j.state is JobState.RUNNING)
        free = max(self.max_concurrent_loads - running, 0)
        if queued >= self.max_queued_loads + free:
            raise BusyError(
                f"{queued} loads are queued already (at most {self.max_queued_loads}); try again later",
                retry_after=5,
            )

    def start(self, job: LoadJob, index: WeightIndex) -> None:
        """Queue ``job`` (reserved already) to load ``index`` as its plan says."""
        self.jobs[job.id] = job
        job.task = asyncio.create_task(self._run(job, index), name=f"load {job.id}")
        job.task.add_done_callback(lambda _: self._finished(job))
        self._prune()

    def record(self, job: LoadJob) -> None:
        """Keep an ended job (a shared load) in the history."""
        self.jobs[job.id] = job
        self._prune()

    def _finished(self, job: LoadJob) -> None:
        # a finished task keeps its frames (and what they referenced) through its result
        # or exception; the job keeps only what it reports
        job.task = None
        if not self.is_resident(job.id):
            self.reservations.release(job.id)
            job.plan = None
        if self.observer is not None:
            self.observer.load_ended(job)

    def _prune(self) -> None:
        """Forget the oldest ended jobs beyond ``job_history``."""
        ended = [j for j in self.jobs.values() if j.state.terminal]
        for job in ended[: max(0, len(ended) - self.job_history)]:
            del self.jobs[job.id]
            self.on_forget(job.id)

    def _fail(self, job: LoadJob, error: dict[str, Any]) -> None:
        job.error = error
        job.transition(JobState.FAILED)
        self.events.publish(job, "error")

    async def _run(self, job: LoadJob, index: WeightIndex) -> None:
        from service.loader.pipeline import load_plan

        async with self._slots:
            if job.state is not JobState.QUEUED:
                return
            job.transition(JobState.RUNNING)
            self.events.publish(job, "state")
            bind_load(job.id, job.model)  # this task's log records name the job and model
            assert job.plan is not None
            for line in job.plan.offload_lines():
                logger.info("%s", line)  # llama.cpp's offload lines, verbatim

            def on_progress(p: Progress) -> None:
                if self.observer is not None:
                    self.observer.load_progressed(job, p.bytes_done - job.bytes_done)
                job.bytes_done = p.bytes_done
                job.bytes_total = p.bytes_total
                self.events.publish(job, "progress", by_device=p.by_device)

            limit = self.load_timeout_s or None
            try:
                async with asyncio.timeout(limit):
                    # the plan made at submit, whose memory was reserved then: not planned again
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
            job.report = loaded.report
            job.warnings = [*loaded.warnings, *(w for w in job.warnings if w not in loaded.warnings)]
            for warning in loaded.warnings:
                if warning not in loaded.plan.warnings:  # those were answered with the plan
                    logger.warning("load %s of %s: %s", job.id, job.model, warning)
                    self.events.publish(job, "warning", warning=warning)
            job.stats = loaded.stats.to_dict()
            job.model_id = job.id
            self.on_loaded(job, loaded)
            job.transition(JobState.SUCCEEDED)
            self.events.publish(job, "report")
            for line in loaded.report.lines():
                logger.info("%s", line)  # llama.cpp's buffer lines, verbatim
            logger.info("loaded %s as %s (%s, %d bytes)", job.model, job.id, job.name, loaded.report.total_nbytes)

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

    async def close(self) -> None:
        """Cancel every job and wait for them."""
        tasks = [job.task for job in self.jobs.values() if job.task is not None and not job.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
