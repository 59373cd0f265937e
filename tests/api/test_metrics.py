"""``GET /metrics`` against the real served app, parsed with prometheus_client's own text
parser, and checked against what ``/v1/devices``, ``/v1/models`` and the jobs report."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from service.api.metrics import Metrics, device_kind
from service.api.settings import Settings
from service.errors import BusyError
from service.loader.devices.base import DeviceMemory
from tests.api.test_loads import put, wait_for
from tests.conftest import _serve
from tests.helpers import mixed_tensors, write_fixture

ENDED = {"succeeded", "failed", "cancelled"}

FAMILIES = {
    "hoist_loads": "counter",
    "hoist_load_bytes": "counter",
    "hoist_load_duration_seconds": "histogram",
    "hoist_loads_running": "gauge",
    "hoist_loads_queued": "gauge",
    "hoist_resident_models": "gauge",
    "hoist_model_memory_bytes": "gauge",
    "hoist_device_free_bytes": "gauge",
    "hoist_device_total_bytes": "gauge",
    "hoist_http_requests": "counter",
    "hoist_http_request_duration_seconds": "histogram",
}


def scrape(client: httpx.Client) -> dict[str, list[Sample]]:
    """The samples of every family, by family name (prometheus_client's parser)."""
    resp = client.get("/metrics")
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(resp.text)}
    for name, kind in FAMILIES.items():
        assert families[name].type == kind, (name, families[name].type)
    return {name: f.samples for name, f in families.items()}


def value(samples: list[Sample], name: str | None = None, **labels: str) -> float:
    """The value of the one sample with ``labels`` (and sample ``name``); 0 when none."""
    found = [s for s in samples if (name is None or s.name == name) and s.labels == labels]
    assert len(found) <= 1, found
    return found[0].value if found else 0.0


def test_metrics_after_a_load_match_the_api(live_server_emu: str, models_dir: Path, tmp_path: Path) -> None:
    gpu_model = put(models_dir, write_fixture(tmp_path / "spread.gguf", tensors=mixed_tensors(0)))
    cpu_model = put(models_dir, write_fixture(tmp_path / "host.gguf", tensors=mixed_tensors(1)))
    with httpx.Client(base_url=live_server_emu, timeout=30) as client:
        before = scrape(client)
        assert value(before["hoist_resident_models"]) == 0
        assert before["hoist_model_memory_bytes"] == []

        jobs = []
        for body in (
            {"model": gpu_model, "n_gpu_layers": "all", "load_mode": "mmap"},
            {"model": cpu_model, "n_gpu_layers": 0, "load_mode": "none"},
        ):
            resp = client.post("/v1/loads", json=body)
            assert resp.status_code == 202, resp.text
            job = wait_for(client, resp.headers["location"], ENDED)
            assert job["state"] == "succeeded", job
            jobs.append(job)
        after = scrape(client)
        devices = client.get("/v1/devices").json()["data"]
        models = client.get("/v1/models").json()["data"]

        # counters moved by exactly these loads, under the load mode each job reports
        for job in jobs:
            mode = job["load_mode"]
            loads = after["hoist_loads"]
            assert value(loads, load_mode=mode, outcome="succeeded") == 1
            assert (
                value(after["hoist_load_bytes"], load_mode=mode) - value(before["hoist_load_bytes"], load_mode=mode)
                == job["bytes_done"]
                > 0
            )
        assert {s.labels["load_mode"] for s in after["hoist_loads"]} == {"mmap", "none"}
        # durations: one observation per load, under the kinds of the devices its buffers are on
        types = {d["name"]: d["type"] for d in devices}
        for job in jobs:
            kind = device_kind(types[name] for name in job["memory_summary"]["by_device"])
            count = value(
                after["hoist_load_duration_seconds"],
                "hoist_load_duration_seconds_count",
                load_mode=job["load_mode"],
                device_kind=kind,
            )
            assert count == 1, (job["load_mode"], kind)
        assert device_kind(types[n] for n in jobs[0]["memory_summary"]["by_device"]) == "cpu+gpu"
        assert device_kind(types[n] for n in jobs[1]["memory_summary"]["by_device"]) == "cpu"

        assert value(after["hoist_resident_models"]) == len(models) == 2
        assert value(after["hoist_loads_running"]) == value(after["hoist_loads_queued"]) == 0

        # per model, device and buffer type: the same bytes as /v1/devices
        expected = {
            (d["name"], buffer_type, use["model"]): nbytes
            for d in devices
            for use in d["models"]
            for buffer_type, nbytes in use["buffer_types"].items()
        }
        got = {
            (s.labels["device"], s.labels["buffer_type"], s.labels["model"]): s.value
            for s in after["hoist_model_memory_bytes"]
        }
        assert got == expected and len(got) >= 4
        assert {m for _, _, m in got} == {gpu_model, cpu_model}
        # and the same as each job's own memory report
        for job in jobs:
            assert sum(v for (_, _, m), v in got.items() if m == job["model"]) == job["memory"]["total_bytes"]

        # device memory: the emulated devices' exactly, the host's within what other processes move
        for d in devices:
            labels = {"device": d["name"], "kind": d["type"].lower()}
            assert value(after["hoist_device_total_bytes"], **labels) == d["total_bytes"]
            free = value(after["hoist_device_free_bytes"], **labels)
            if d["name"].startswith("EMU"):
                assert free == d["free_bytes"] < d["total_bytes"]
            else:
                assert abs(free - d["free_bytes"]) < 0.1 * d["total_bytes"]

        # requests are counted by route template: no job or model id becomes a label
        job_route = [
            s
            for s in after["hoist_http_requests"]
            if s.labels["handler"] == "/v1/loads/{job_id}" and s.labels["method"] == "GET"
        ]
        assert job_route and job_route[0].labels["status"] == "2xx" and job_route[0].value >= 2
        text = client.get("/metrics").text
        assert all(job["id"] not in text for job in jobs)

        # unloading removes the model's series and frees the emulated devices
        for job in jobs:
            assert client.delete(f"/v1/models/{job['model_id']}").status_code == 200
        unloaded = scrape(client)
        assert unloaded["hoist_model_memory_bytes"] == []
        assert value(unloaded["hoist_resident_models"]) == 0
        for d in devices:
            if d["name"].startswith("EMU"):
                labels = {"device": d["name"], "kind": "gpu"}
                assert value(unloaded["hoist_device_free_bytes"], **labels) == d["total_bytes"]
        # counters never go back
        assert value(unloaded["hoist_loads"], load_mode="mmap", outcome="succeeded") == 1


def test_route_labels_stay_templates(live_server: str) -> None:
    with httpx.Client(base_url=live_server, timeout=30) as client:
        for i in range(20):
            assert client.get(f"/v1/loads/lj_{i:04d}nothere").status_code == 404
            assert client.get(f"/no/such/path/{i}").status_code == 404
            assert client.delete(f"/v1/models/m{i}").status_code == 404
        samples = scrape(client)
    handlers = {s.labels["handler"] for s in samples["hoist_http_requests"]}
    assert handlers <= {"/v1/loads/{job_id}", "/v1/models/{ref:model_ref}", "none", "/metrics"}, handlers
    by = {(s.labels["handler"], s.labels["method"]): s.value for s in samples["hoist_http_requests"]}
    assert by[("/v1/loads/{job_id}", "GET")] == 20
    assert by[("/v1/models/{ref:model_ref}", "DELETE")] == 20
    assert by[("none", "GET")] == 20
    statuses = {s.labels["status"] for s in samples["hoist_http_requests"]}
    assert statuses <= {"2xx", "4xx"}


TOKEN = "metrics-test-token"


@pytest.fixture
def token_server(models_dir: Path) -> Iterator[str]:
    yield from _serve(Settings(models_dir=models_dir, cuda=False, api_token=TOKEN))


def test_metrics_need_the_token(token_server: str) -> None:
    with httpx.Client(base_url=token_server, timeout=30) as client:
        assert client.get("/healthz").status_code == 200
        refused = client.get("/metrics")
        assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Bearer")
    with httpx.Client(base_url=token_server, timeout=30, headers={"Authorization": f"Bearer {TOKEN}"}) as client:
        samples = scrape(client)
    # the refused scrape was counted, under its route
    assert value(samples["hoist_http_requests"], handler="/metrics", method="GET", status="4xx") == 1


# -- the scrape stays off the event loop, bounded in time ------------------------------------------


class SlowDevice:
    """A device whose memory query blocks until released (as a stuck CUDA call would)."""

    name = "SLOW0"
    type = "GPU"

    def __init__(self) -> None:
        self.release = threading.Event()

    def memory(self) -> DeviceMemory:
        self.release.wait(30)
        return DeviceMemory(free=1 << 20, total=2 << 20)


class BrokenDevice:
    name = "BROKEN0"
    type = "GPU"

    def memory(self) -> DeviceMemory:
        raise RuntimeError("the driver went away")


def _jobs(*devices: Any) -> Any:
    return SimpleNamespace(jobs={}, models={}, devices=list(devices))


async def test_a_stuck_device_query_neither_blocks_the_loop_nor_piles_up() -> None:
    metrics = Metrics(timeout_s=0.3)
    slow = SlowDevice()
    jobs = _jobs(slow)
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.create_task(tick())
    try:
        started = time.monotonic()
        results = await asyncio.gather(*(metrics.exposition(jobs) for _ in range(5)), return_exceptions=True)
        assert all(isinstance(r, BusyError) for r in results), results
        assert time.monotonic() - started < 2
        assert ticks >= 10  # the loop kept running while the query hung
        assert metrics._pool._work_queue.qsize() == 0  # one query under way, none queued behind it
        slow.release.set()
        deadline = time.monotonic() + 10
        while True:
            try:
                text = (await metrics.exposition(jobs)).decode()
                break
            except BusyError:
                assert time.monotonic() < deadline
        assert 'hoist_device_free_bytes{device="SLOW0",kind="gpu"} 1.048576e+06' in text
    finally:
        ticker.cancel()
        slow.release.set()
        metrics.close()


async def test_a_failing_device_is_left_out_of_the_scrape() -> None:
    metrics = Metrics()
    working = SlowDevice()
    working.release.set()
    try:
        text = (await metrics.exposition(_jobs(BrokenDevice(), working))).decode()
    finally:
        metrics.close()
    free = {f.name: f for f in text_string_to_metric_families(text)}["hoist_device_free_bytes"]
    assert [s.labels["device"] for s in free.samples] == ["SLOW0"]


def test_device_kind() -> None:
    assert device_kind(["CPU", "GPU", "GPU"]) == "cpu+gpu"
    assert device_kind(["CPU"]) == "cpu"
    assert device_kind(["ACCEL", "CPU"]) == "accel+cpu"
