"""A load in this process, with the same events the service sends (no server needed):
the progress callback of :func:`~service.loader.pipeline.load_model` (returning ``False``
cancels) and an async iterator of the load's events."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Sequence

from service.api.errors import public_error
from service.api.events import Event, EventHub
from service.api.jobs import JobState, LoadJob
from service.errors import HoistError, LoadCancelledError
from service.loader.devices import CPUDevice, Device
from service.loader.model import LoadedModel
from service.loader.pipeline import LoadOptions, Progress, ProgressCallback, check_budget, load_plan, staging_nbytes
from service.loader.placement import MemorySnapshot, PlacementParams, plan
from service.loader.weights import WeightIndex


class LocalLoad:
    """Load ``index`` on ``devices`` as ``params`` place it, in the background of the
    running event loop, and tell it as events.

    Args:
        index: the model's weights (:func:`~service.loader.weights.open_model`).
        devices: where to place it (default: the CPU alone).
        params: the placement flags (default: every layer offloaded, mmap).
        options: how bytes move (chunk size, staging buffers, check-tensors, hash-tensors).
        on_progress: called with :class:`~service.loader.pipeline.Progress` (bytes done,
            bytes total, per device) as llama.cpp's ``progress_callback``; returning
            ``False`` cancels the load.
        job_id: the id the events carry.

    Use ``async for event in load.events()`` (:class:`~service.api.events.Event`: ``kind``,
    ``seq``, ``json()`` the same JSON as ``/v1/loads/{id}/events``), then
    ``await load.result()`` for the :class:`LoadedModel` (the caller closes it).
    ``cancel()`` stops it. Planning errors (PlacementError, BudgetExceededError) are
    raised by :meth:`start`; load errors by :meth:`result`, and told as an ``error``
    event.
    """

    def __init__(
        self,
        index: WeightIndex,
        *,
        devices: Sequence[Device] | None = None,
        params: PlacementParams | None = None,
        options: LoadOptions | None = None,
        on_progress: ProgressCallback | None = None,
        job_id: str = "local",
    ) -> None:
        self.index = index
        self.devices = list(devices) if devices is not None else [CPUDevice()]
        self.params = params or PlacementParams()
        self.options = options or LoadOptions()
        self.on_progress = on_progress
        self.job_id = job_id
        self.hub = EventHub(os.path.dirname(index.path))
        self.job: LoadJob | None = None
        self._task: asyncio.Task[LoadedModel] | None = None

    async def start(self) -> LoadJob:
        """Plan (on a thread), check the devices' free memory, and start loading.
        Raises PlacementError or BudgetExceededError."""
        if self.job is not None:
            return self.job
        devices, params = self.devices, self.params
        placement = await asyncio.to_thread(
            lambda: plan(self.index, devices, params, memory=MemorySnapshot.take(devices))
        )
        check_budget(placement, staging=staging_nbytes(placement, self.devices, self.options))
        job = self.job = LoadJob(
            id=self.job_id,
            model=os.path.basename(self.index.path),
            path=self.index.path,
            params=self.params,
            plan=placement,
            n_tensors=len(self.index),
            bytes_total=sum(t.nbytes for t in placement.tensors),
            options=self.options,
            warnings=list(placement.warnings),
        )
        self._task = asyncio.create_task(self._run(job), name=f"load {self.job_id}")
        return job

    async def _run(self, job: LoadJob) -> LoadedModel:
        assert job.plan is not None
        job.transition(JobState.RUNNING)
        self.hub.publish(job, "state")

        def progress(p: Progress) -> bool | None:
            job.bytes_done, job.bytes_total = p.bytes_done, p.bytes_total
            self.hub.publish(job, "progress", by_device=p.by_device)
            return self.on_progress(p) if self.on_progress is not None else None

        try:
            loaded = await load_plan(self.index, job.plan, self.devices, options=self.options, on_progress=progress)
        except asyncio.CancelledError:
            job.transition(JobState.CANCELLED)
            self.hub.publish(job, "state")
            raise
        except HoistError as exc:
            if isinstance(exc, LoadCancelledError):
                job.transition(JobState.CANCELLED)
                self.hub.publish(job, "state")
            else:
                job.error = public_error(exc, os.path.dirname(self.index.path))
                job.transition(JobState.FAILED)
                self.hub.publish(job, "error")
            raise
        for warning in loaded.warnings:
            if warning not in job.warnings:
                job.warnings.append(warning)
                self.hub.publish(job, "warning", warning=warning)
        job.report = loaded.report
        job.stats = loaded.stats.to_dict()
        job.memory_summary = {
            "by_device": loaded.report.by_device(),
            "total_bytes": loaded.report.total_nbytes,
            "n_buffers": len(loaded.report.buffers),
        }
        job.transition(JobState.SUCCEEDED)
        self.hub.publish(job, "report")
        return loaded

    async def events(self, *, after: int | None = None) -> AsyncIterator[Event]:
        """The load's events (starting it if needed): a snapshot, progress (at most about
        ten a second), state changes, warnings, then the final report or error."""
        job = await self.start()
        async for event in self.hub.follow(job, after=after):
            yield event

    async def result(self) -> LoadedModel:
        """The loaded model. Raises what the load raised (LoadCancelledError when the
        callback cancelled it)."""
        await self.start()
        assert self._task is not None
        return await self._task

    def cancel(self) -> None:
        """Stop the load; it ends ``cancelled`` once it released everything."""
        if self._task is not None:
            self._task.cancel()
