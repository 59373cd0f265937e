"""The job manager: state machine, cancellation frees memory, bounded history."""

from __future__ import annotations

import asyncio
import gc
import threading
import tracemalloc
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from service.api.jobs import JobManager, JobState, Limits, LoadJob, LoadSpec
from service.loader.devices import CPUDevice
from service.loader.pipeline.worker import Worker
from service.loader.placement import MemorySnapshot, PlacementParams, plan
from service.loader.weights import open_model
from tests.helpers import write_fixture


def test_state_machine_refuses_illegal_moves(tmp_path: Path) -> None:
    path = write_fixture(
        tmp_path / "m.gguf", tensors={"w": (np.ones(8, dtype=np.float32), gguf.GGMLQuantizationType.F32)}
    ).path
    params = PlacementParams()
    cpu = [CPUDevice()]
    job = LoadJob(
        id="lj_x", model="m", path=str(path), params=params,
        plan=plan(open_model(path), cpu, params, memory=MemorySnapshot.take(cpu)),
        n_tensors=1, bytes_total=32,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="expected a move to cancelled, running, got succeeded"):
        job.transition(JobState.SUCCEEDED)
    job.transition(JobState.RUNNING)
    job.transition(JobState.FAILED)
    with pytest.raises(RuntimeError, match="nothing"):
        job.transition(JobState.RUNNING)


async def test_a_cancelled_load_frees_its_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    models = tmp_path / "models"
    models.mkdir()
    f32 = gguf.GGMLQuantizationType.F32
    write_fixture(models / "big.gguf", tensors={"w": (np.ones(8 << 20, dtype=np.float32), f32)})  # 32 MiB
    inside = threading.Event()

    def gated(self: Worker) -> None:
        inside.set()
        self.cancel.wait(30)

    monkeypatch.setattr(Worker, "_work", gated)
    jobs = JobManager(str(models), [CPUDevice()])
    tracemalloc.start()
    try:
        job = await jobs.submit(LoadSpec.of("big.gguf", load_mode="none"))
        while not inside.is_set():
            await asyncio.sleep(0.01)
        held = tracemalloc.get_traced_memory()[0]
        assert held > 30 << 20  # the 32 MiB buffer is allocated
        jobs.cancel(job.id)
        while not job.state.terminal:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0)
        gc.collect()
        assert job.state is JobState.CANCELLED and job.task is None
        assert tracemalloc.get_traced_memory()[0] < 8 << 20
    finally:
        tracemalloc.stop()
        await jobs.close()


def _models_with_m(tmp_path: Path) -> Path:
    """A models directory holding ``m.gguf``, one small F32 tensor."""
    models = tmp_path / "models"
    models.mkdir()
    write_fixture(models / "m.gguf", tensors={"w": (np.ones(8, dtype=np.float32), gguf.GGMLQuantizationType.F32)})
    return models


async def test_job_history_is_bounded(tmp_path: Path) -> None:
    models = _models_with_m(tmp_path)
    jobs = JobManager(str(models), [CPUDevice()], Limits(job_history=3))
    try:
        for _ in range(6):
            job = await jobs.submit(LoadSpec.of("m.gguf", load_mode="mmap"))
            while not job.state.terminal:
                await asyncio.sleep(0.01)
            await jobs.unload(job.id)
        # the newest submission is kept even while the older ended ones are pruned
        assert len(jobs.jobs) <= 4
        assert job.id in jobs.jobs
    finally:
        await jobs.close()


async def test_a_failed_load_frees_its_memory_without_a_garbage_collection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from service.io import direct
    from service.io.meter import HOST_MEMORY

    models = tmp_path / "models"
    models.mkdir()
    f32 = gguf.GGMLQuantizationType.F32
    tensors = {f"blk.0.w{i}": (np.ones(2 << 20, dtype=np.float32), f32) for i in range(4)}  # 4 x 8 MiB
    path = write_fixture(models / "big.gguf", tensors=tensors).path
    real = direct.pread_into

    def read_then_shrink(fd, dest, offset, *, path, tensor=None):  # type: ignore[no-untyped-def]
        real(fd, dest, offset, path=path, tensor=tensor)
        os.truncate(path, offset)  # the next read comes up short

    monkeypatch.setattr(direct, "pread_into", read_then_shrink)
    jobs = JobManager(str(models), [CPUDevice()])
    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        job = await jobs.submit(LoadSpec.of(path.name, load_mode="none"))
        while not job.state.terminal:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0)
        assert job.state is JobState.FAILED and job.error is not None
        assert job.error["code"] == "storage_error"
        # the 32 MiB buffer is gone, with no collection of reference cycles
        assert tracemalloc.get_traced_memory()[0] < 8 << 20
        assert HOST_MEMORY.nbytes == 0
    finally:
        tracemalloc.stop()
        gc.enable()
        await jobs.close()


async def test_loads_beyond_the_mapping_limit_are_refused_at_submit(tmp_path: Path) -> None:
    from service.api.admission import MAPPINGS_PER_FILE
    from service.errors import BudgetExceededError

    models = _models_with_m(tmp_path)
    jobs = JobManager(str(models), [CPUDevice()], Limits())
    # room for the mappings of two mapped files
    jobs.reservations.mapping_capacity = 2 * MAPPINGS_PER_FILE
    try:
        first = await jobs.submit(LoadSpec.of("m.gguf", name="a", load_mode="mmap"))
        second = await jobs.submit(LoadSpec.of("m.gguf", name="b", load_mode="mmap"))
        with pytest.raises(BudgetExceededError, match="memory mappings.*vm.max_map_count"):
            await jobs.submit(LoadSpec.of("m.gguf", name="c", load_mode="mmap"))
        while not (first.state.terminal and second.state.terminal):
            await asyncio.sleep(0.01)
        assert first.state is JobState.SUCCEEDED and second.state is JobState.SUCCEEDED
        # a resident model keeps its mapping reserved; unloading one makes room again
        with pytest.raises(BudgetExceededError):
            await jobs.submit(LoadSpec.of("m.gguf", name="c", load_mode="mmap"))
        await jobs.unload(first.id)
        third = await jobs.submit(LoadSpec.of("m.gguf", name="c", load_mode="mmap"))
        while not third.state.terminal:
            await asyncio.sleep(0.01)
        assert third.state is JobState.SUCCEEDED
    finally:
        await jobs.close()


async def test_loads_beyond_the_descriptor_limit_are_refused_at_submit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from service.api.admission import DESCRIPTORS
    from service.errors import BudgetExceededError
    from service.loader.pipeline.options import LoadOptions

    models = _models_with_m(tmp_path)
    jobs = JobManager(str(models), [CPUDevice()], Limits())
    jobs.reservations.descriptor_capacity = 3
    go = asyncio.Event()
    from service.loader import pipeline  # the job runner imports load_plan from it when a load starts

    real = pipeline.load_plan

    async def held(*args: Any, **kwargs: Any) -> Any:  # the first load runs until told
        await go.wait()
        return await real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "load_plan", held)
    try:
        checked = LoadOptions(check_tensors=True)
        first = await jobs.submit(LoadSpec.of("m.gguf", name="a", options=checked, load_mode="none"))
        assert jobs.reservations.owners[first.id][DESCRIPTORS] == 2  # the file, and again to validate it
        with pytest.raises(BudgetExceededError, match="file descriptors.*RLIMIT_NOFILE"):
            await jobs.submit(LoadSpec.of("m.gguf", name="b", options=checked, load_mode="none"))
        second = await jobs.submit(LoadSpec.of("m.gguf", name="b", load_mode="none"))
        go.set()
        while not (first.state.terminal and second.state.terminal):
            await asyncio.sleep(0.01)
        assert first.state is JobState.SUCCEEDED and second.state is JobState.SUCCEEDED
        # resident models hold no descriptors
        assert all(DESCRIPTORS not in needs for needs in jobs.reservations.owners.values())
    finally:
        await jobs.close()
