"""Resident models are bounded and listed in pages: models without tensors cost the
service metadata and listing work all the same, so their number is limited at submit;
an unloaded model's job keeps its summary."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from gguf import GGUFValueType as V

from service.api.jobs import JobManager, JobState, Limits, LoadSpec
from service.api.settings import Settings
from service.errors import ModelLimitError
from service.loader.devices import CPUDevice
from tests.api.test_hostile import ENDED, is_problem
from tests.api.test_loads import wait_for
from tests.conftest import _serve
from tests.helpers import gguf_kv, gguf_string, raw_gguf

LIMIT = 3


def _empty_model(path: Path) -> Path:
    """A valid GGUF file with an architecture and no tensors."""
    path.write_bytes(raw_gguf([gguf_kv("general.architecture", V.STRING, gguf_string("llama"))], []))
    return path


@pytest.fixture
def limited_server(models_dir: Path) -> Iterator[str]:
    _empty_model(models_dir / "empty.gguf")
    yield from _serve(Settings(models_dir=models_dir, cuda=False, max_resident_models=LIMIT))


def test_models_beyond_the_limit_are_refused_until_one_is_unloaded(limited_server: str) -> None:
    with httpx.Client(base_url=limited_server, timeout=60) as client:
        locations = []
        for i in range(LIMIT):
            resp = client.post("/v1/loads", json={"model": "empty.gguf", "name": f"m{i}"})
            assert resp.status_code == 202, resp.text
            locations.append(resp.headers["location"])
        # queued and running loads count: the limit holds before any of them ended
        body = is_problem(client.post("/v1/loads", json={"model": "empty.gguf", "name": "x"}), 409, "model_limit")
        assert f"at most {LIMIT} models" in body["detail"] and "unload" in body["hint"]
        jobs = [wait_for(client, location, ENDED) for location in locations]
        assert [j["state"] for j in jobs] == ["succeeded"] * LIMIT
        is_problem(client.post("/v1/loads", json={"model": "empty.gguf", "name": "x"}), 409, "model_limit")
        # a load that shares a resident model adds none: not refused
        shared = client.post("/v1/loads", json={"model": "empty.gguf", "name": "m1"})
        assert shared.status_code == 202 and shared.json()["shared"] is True, shared.text
        # a dry run allocates nothing and is not counted
        assert client.post("/v1/plans", json={"model": "empty.gguf"}).status_code == 200

        model_id = jobs[0]["model_id"]
        assert client.delete(f"/v1/models/{model_id}").status_code == 200
        resp = client.post("/v1/loads", json={"model": "empty.gguf", "name": "x"})
        assert resp.status_code == 202, resp.text
        assert wait_for(client, resp.headers["location"], ENDED)["state"] == "succeeded"
        is_problem(client.post("/v1/loads", json={"model": "empty.gguf", "name": "y"}), 409, "model_limit")


def test_an_unloaded_models_job_keeps_its_summary(limited_server: str) -> None:
    with httpx.Client(base_url=limited_server, timeout=60) as client:
        resp = client.post("/v1/loads", json={"model": "empty.gguf"})
        location = resp.headers["location"]
        job = wait_for(client, location, ENDED)
        assert job["state"] == "succeeded" and job["memory"] is not None
        assert client.delete(f"/v1/models/{job['model_id']}").status_code == 200
        after = client.get(location).json()
        assert after["state"] == "succeeded" and after["model_id"] == job["model_id"]
        assert after["memory"] is None and after["memory_summary"] == job["memory_summary"]
        is_problem(client.get(f"/v1/models/{job['model_id']}"), 404, "not_found")
        is_problem(client.delete(f"/v1/models/{job['model_id']}"), 404, "not_found")


def test_models_are_listed_in_pages_without_their_report(limited_server: str) -> None:
    with httpx.Client(base_url=limited_server, timeout=60) as client:
        ids = []
        for i in range(LIMIT):
            resp = client.post("/v1/loads", json={"model": "empty.gguf", "name": f"m{i}"})
            ids.append(wait_for(client, resp.headers["location"], ENDED)["model_id"])
        everything = client.get("/v1/models").json()
        assert everything["total"] == LIMIT and [m["id"] for m in everything["data"]] == ids
        page = client.get("/v1/models", params={"limit": 2, "offset": 1}).json()
        assert page["total"] == LIMIT and [m["id"] for m in page["data"]] == ids[1:]
        assert client.get("/v1/models", params={"offset": LIMIT}).json() == {"data": [], "total": LIMIT}
        for params in ({"limit": 0}, {"limit": 1001}, {"offset": -1}, {"offset": 1_000_001}):
            is_problem(client.get("/v1/models", params=params), 422, "validation_error")
        # listings leave the report out (the key too); the model itself has it
        for listed in page["data"]:
            assert "memory" not in listed
            assert listed["memory_summary"] == client.get(f"/v1/models/{listed['id']}").json()["memory_summary"]
        for job in client.get("/v1/loads").json()["data"]:
            assert "memory" not in job and job["memory_summary"] is not None
            assert client.get(f"/v1/loads/{job['id']}").json()["memory"] is not None


async def test_only_queued_running_and_resident_loads_count(models_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from service.loader import pipeline  # the job runner imports load_plan from it when a load starts

    _empty_model(models_dir / "empty.gguf")
    go = asyncio.Event()
    real = pipeline.load_plan

    async def held(*args: Any, **kwargs: Any) -> Any:
        await go.wait()
        return await real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "load_plan", held)
    jobs = JobManager(str(models_dir), [CPUDevice()], Limits(max_resident_models=LIMIT))
    try:
        first = [await jobs.submit(LoadSpec.of("empty.gguf", name=f"m{i}")) for i in range(LIMIT)]
        await asyncio.sleep(0.05)
        assert [j.state for j in first] == [JobState.RUNNING] + [JobState.QUEUED] * (LIMIT - 1)
        with pytest.raises(ModelLimitError, match=f"0 models are resident and {LIMIT} loads"):
            await jobs.submit(LoadSpec.of("empty.gguf", name="x"))
        # a cancelled load leaves room at once
        jobs.cancel(first[-1].id)
        last = await jobs.submit(LoadSpec.of("empty.gguf", name="last"))
        go.set()
        while not all(j.state.terminal for j in (*first, last)):
            await asyncio.sleep(0.01)
        assert len(jobs.models) == LIMIT
        with pytest.raises(ModelLimitError, match=f"{LIMIT} models are resident and 0 loads"):
            await jobs.submit(LoadSpec.of("empty.gguf", name="x"))
        # a load that fails leaves no model: only the failure's own submit was counted
        await jobs.unload(last.id)
        (models_dir / "bad.gguf").write_bytes(b"GGUF" + b"\0" * 8)
        with pytest.raises(Exception, match="bad.gguf"):
            await jobs.submit(LoadSpec.of("bad.gguf"))
        assert (await jobs.submit(LoadSpec.of("empty.gguf", name="y"))).state is JobState.QUEUED
    finally:
        await jobs.close()
