"""Live events of load jobs against the real server, with real websocket (``websockets``)
and server-sent-event (httpx streaming) clients; a load paced by an emulated device's
bandwidth so that its progress can be watched."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import websockets
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from service.api.event_schema import LoadEvent
from service.api.events import EventHub
from service.api.jobs import JobState, LoadJob
from service.api.settings import Settings
from service.loader.placement import PlacementParams
from tests.conftest import _serve
from tests.helpers import write_fixture

MiB = 1 << 20
EMBD_BYTES = 64 * 4
LAYER_BYTES = 2 * MiB
TOKEN = "events-test-token"


def _model(path: Path) -> Path:
    """Two F32 layers of ``LAYER_BYTES`` each that go to EMU0 with -ngl 99; the token
    embedding (``EMBD_BYTES``) stays on the CPU, and its tied output copy goes to EMU0."""
    tensors = {
        "token_embd.weight": (np.ones(EMBD_BYTES // 4, dtype=np.float32), Q.F32),
        "blk.0.attn_q.weight": (np.ones(LAYER_BYTES // 4, dtype=np.float32), Q.F32),
        "blk.1.attn_q.weight": (np.ones(LAYER_BYTES // 4, dtype=np.float32), Q.F32),
    }
    write_fixture(path, kv=[("llama.block_count", 2, V.UINT32, None)], tensors=tensors)
    return path


# one small staging buffer: bytes are counted as they reach EMU0, not far ahead
BODY = {"model": "m.gguf", "load_mode": "none", "n_gpu_layers": 99, "staging_buffers": 1, "staging_size": 256 << 10}


def _settings(models_dir: Path, **extra: Any) -> Settings:
    _model(models_dir / "m.gguf")
    # 4 MiB at 2 MiB/s: about two seconds of load, longer than the read time limit
    return Settings(
        models_dir=models_dir,
        cuda=False,
        emulated_devices="EMU0=64MiB:bandwidth=2MiB",
        request_read_timeout_s=1.0,
        **extra,
    )


@pytest.fixture
def server(models_dir: Path) -> Iterator[str]:
    yield from _serve(_settings(models_dir))


@pytest.fixture
def token_server(models_dir: Path) -> Iterator[str]:
    yield from _serve(_settings(models_dir, api_token=TOKEN))


def _ws(url: str) -> str:
    return url.replace("http://", "ws://", 1)


async def _start(url: str, headers: dict[str, str] | None = None) -> str:
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as client:
        r = await client.post("/v1/loads", json=BODY)
        assert r.status_code == 202, r.text
        job_id: str = r.json()["id"]
        return job_id


async def _follow(url: str, job_id: str, *, delay_s: float = 0.0, **kw: Any) -> list[dict[str, Any]]:
    """Every message of the job's websocket until it closes; after ``delay_s`` seconds
    of not reading."""
    events = []
    async with websockets.connect(f"{_ws(url)}/v1/loads/{job_id}/events", **kw) as ws:
        if delay_s:
            await asyncio.sleep(delay_s)
        async for message in ws:
            events.append(json.loads(message))
        assert ws.close_code == 1000
    return events


def _check_stream(events: list[dict[str, Any]], *, live: bool = True) -> None:
    """Every event valid; snapshot first, final report last; numbers and bytes never go back."""
    for e in events:
        LoadEvent.model_validate(e)
    assert events[0]["event"] == "snapshot"
    assert events[-1]["event"] == "report" and events[-1]["final"] is True
    assert [e["final"] for e in events[:-1]] == [False] * (len(events) - 1)
    seqs = [e["seq"] for e in events if e["event"] != "heartbeat"]
    if live:
        assert all(b > a for a, b in zip(seqs[1:-1], seqs[2:], strict=False)), seqs
    assert seqs == sorted(seqs)
    done = [e["bytes_done"] for e in events]
    assert done == sorted(done)
    for e in events:
        assert sum(e["by_device"].values()) == e["bytes_done"], e


async def test_a_load_followed_over_a_websocket_to_its_report(server: str) -> None:
    job_id = await _start(server)
    started = time.monotonic()
    events = await _follow(server, job_id)
    took = time.monotonic() - started
    _check_stream(events)
    # the bytes per device as the fixture placed them: -ngl 99 puts the layers and the
    # output layer on EMU0, and without output.weight the output is the token embedding
    # copied there (as llama.cpp ties it)
    total = 2 * EMBD_BYTES + 2 * LAYER_BYTES
    last = events[-1]
    assert last["by_device"] == {"CPU": EMBD_BYTES, "EMU0": 2 * LAYER_BYTES + EMBD_BYTES}
    assert last["bytes_done"] == last["bytes_total"] == total and last["progress"] == 1.0
    assert last["state"] == "succeeded" and last["eta_s"] == 0.0
    # the job's own view agrees with the report event
    async with httpx.AsyncClient(base_url=server) as client:
        job = (await client.get(f"/v1/loads/{job_id}")).json()
    assert last["report"]["memory_summary"] == job["memory_summary"]
    assert last["report"]["plan_lines"] == job["plan"]["lines"]
    kinds = [e["event"] for e in events]
    assert kinds[-2:] == ["state", "report"] and "running" in {e["state"] for e in events}
    progress = [e for e in events if e["event"] == "progress"]
    # paced at 2 MiB/s: progress is seen along the way, at most about ten a second
    assert len(progress) >= 5, kinds
    times = [datetime.fromisoformat(e["time"]) for e in progress]
    gaps = [(b - a).total_seconds() for a, b in zip(times, times[1:], strict=False)]
    assert min(gaps) >= 0.09, gaps
    assert len(progress) <= took * 10 + 2
    mid = [e for e in progress if 0 < e["bytes_done"] < total]
    assert mid and all(e["throughput_bps"] > 0 and e["eta_s"] > 0 for e in mid)
    # the connection outlived the request read time limit (1 s) of the HTTP protocol
    assert took > 1.2


async def test_two_subscribers_one_slow(server: str) -> None:
    job_id = await _start(server)
    started = time.monotonic()
    # the slow one reads nothing until well after the load ended
    fast_task = asyncio.create_task(_follow(server, job_id))
    slow_task = asyncio.create_task(_follow(server, job_id, delay_s=4.0, max_queue=1))
    fast = await fast_task
    fast_took = time.monotonic() - started
    slow = await slow_task
    _check_stream(fast)
    _check_stream(slow)
    assert fast_took < 3.5, "the slow subscriber held the load back"
    assert fast[-1]["report"] == slow[-1]["report"] and fast[-1]["seq"] == slow[-1]["seq"]


async def test_a_subscriber_after_completion(server: str) -> None:
    job_id = await _start(server)
    await _follow(server, job_id)
    late = await _follow(server, job_id)
    _check_stream(late, live=False)
    assert [e["event"] for e in late] == ["snapshot", "report"]
    assert late[0]["state"] == "succeeded" and late[0]["seq"] == late[1]["seq"]


async def test_a_cancelled_load_ends_its_stream(server: str) -> None:
    job_id = await _start(server)
    async with websockets.connect(f"{_ws(server)}/v1/loads/{job_id}/events") as ws:
        first = json.loads(await ws.recv())
        assert first["event"] == "snapshot"
        async with httpx.AsyncClient(base_url=server) as client:
            assert (await client.post(f"/v1/loads/{job_id}/cancel")).status_code == 202
        rest = [json.loads(m) async for m in ws]
    assert rest[-1]["event"] == "state" and rest[-1]["state"] == "cancelled" and rest[-1]["final"]
    assert all(not e["final"] for e in rest[:-1])


async def _sse(
    url: str, job_id: str, headers: dict[str, str], count: int | None = None
) -> AsyncIterator[dict[str, Any]]:
    """Parsed server-sent events (``id`` and ``event`` fields beside the JSON), ``count`` of them at most."""
    async with (
        httpx.AsyncClient(base_url=url, timeout=30) as client,
        client.stream("GET", f"/v1/loads/{job_id}/events", headers={"accept": "text/event-stream", **headers}) as r,
    ):
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        fields: dict[str, str] = {}
        seen = 0
        async for line in r.aiter_lines():
            if line:
                name, _, value = line.partition(": ")
                fields[name] = value
                continue
            if "data" in fields:
                data = json.loads(fields["data"])
                assert data["event"] == fields["event"]
                assert fields.get("id") == (None if data["event"] == "heartbeat" else str(data["seq"]))
                yield data
                seen += 1
                if count is not None and seen >= count:
                    return
            fields = {}


async def test_server_sent_events_resume_from_the_last_event_id(server: str) -> None:
    job_id = await _start(server)
    head = [e async for e in _sse(server, job_id, {}, count=3)]
    assert head[0]["event"] == "snapshot"
    last = head[-1]["seq"]
    rest = [e async for e in _sse(server, job_id, {"last-event-id": str(last)})]
    # resumed: no snapshot, the very next event, none missed, up to the report
    assert rest[0]["event"] != "snapshot" and rest[0]["seq"] == last + 1
    seqs = [e["seq"] for e in rest]
    assert seqs == list(range(last + 1, last + 1 + len(seqs)))
    assert rest[-1]["event"] == "report"
    _check_stream(head + rest)
    async with httpx.AsyncClient(base_url=server) as client:
        url = f"/v1/loads/{job_id}/events"
        # everything seen: nothing more to send (an EventSource stops on 204)
        r = await client.get(url, headers={"accept": "text/event-stream", "last-event-id": str(seqs[-1])})
        assert r.status_code == 204
        # an earlier id once the job ended: the final event alone (the others are gone)
        late = [e async for e in _sse(server, job_id, {"last-event-id": str(seqs[-2])})]
        assert [(e["event"], e["seq"]) for e in late] == [("report", seqs[-1])]
        # an id from elsewhere starts anew with a snapshot
        anew = [e async for e in _sse(server, job_id, {"last-event-id": "999999"})]
        assert [e["event"] for e in anew] == ["snapshot", "report"]
        r = await client.get(url, headers={"accept": "application/json"})
        assert r.status_code == 406 and r.json()["code"] == "not_acceptable"
        r = await client.get("/v1/loads/lj_nope/events", headers={"accept": "text/event-stream"})
        assert r.status_code == 404 and r.headers["content-type"].startswith("application/problem+json")


async def test_unknown_jobs_are_refused_before_the_handshake(server: str) -> None:
    with pytest.raises(websockets.InvalidStatus) as refused:
        async with websockets.connect(f"{_ws(server)}/v1/loads/lj_nope/events"):
            pass
    assert refused.value.response.status_code == 404
    assert json.loads(refused.value.response.body)["code"] == "not_found"


async def test_the_token_applies_to_websockets_and_server_sent_events(token_server: str) -> None:
    auth = {"authorization": f"Bearer {TOKEN}"}
    job_id = await _start(token_server, auth)
    url = f"{_ws(token_server)}/v1/loads/{job_id}/events"
    for headers in ({}, {"authorization": "Bearer wrong"}):
        with pytest.raises(websockets.InvalidStatus) as refused:
            async with websockets.connect(url, additional_headers=headers):
                pass
        assert refused.value.response.status_code == 401
        assert json.loads(refused.value.response.body)["code"] == "unauthorized"
        async with httpx.AsyncClient(base_url=token_server) as client:
            r = await client.get(f"/v1/loads/{job_id}/events", headers={"accept": "text/event-stream", **headers})
            assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
    _check_stream(await _follow(token_server, job_id, additional_headers=auth))
    sse = [e async for e in _sse(token_server, job_id, auth)]
    assert [e["event"] for e in sse] == ["snapshot", "report"]


# -- the hub on its own -------------------------------------------------------------------


def _job() -> LoadJob:
    return LoadJob("lj_test", "m.gguf", "/m/m.gguf", PlacementParams(), None, n_tensors=1, bytes_total=1000)


async def test_a_lagging_subscriber_gets_a_fresh_snapshot_and_publishing_never_waits() -> None:
    hub = EventHub("/m", progress_interval_s=0.0, queue_events=4, heartbeat_s=0.05)
    job = _job()
    job.transition(JobState.RUNNING)
    stream = hub.follow(job)
    first = await anext(stream)
    assert first.kind == "snapshot" and first.seq == 0
    for i in range(1, 11):  # far beyond the queue, with nobody reading
        job.bytes_done = i * 100
        hub.publish(job, "progress", by_device={"CPU": i * 100})
    again = await anext(stream)
    # the backlog is gone: a snapshot of the job as it is now stands for it
    assert again.kind == "snapshot" and again.seq == 10 and again.json()["bytes_done"] == 1000
    beat = await anext(stream)
    assert beat.kind == "heartbeat" and beat.seq == 10
    job.transition(JobState.CANCELLED)
    hub.publish(job, "state")
    end = await anext(stream)
    assert end.kind == "state" and end.final and end.seq == 11
    with pytest.raises(StopAsyncIteration):
        await anext(stream)
    assert not hub.channel(job).subscribers


async def test_progress_is_coalesced_to_the_interval() -> None:
    hub = EventHub("/m", progress_interval_s=0.2, heartbeat_s=10)
    job = _job()
    job.transition(JobState.RUNNING)
    stream = hub.follow(job)
    await anext(stream)
    for i in range(1, 51):
        job.bytes_done = i * 20
        hub.publish(job, "progress", by_device={"CPU": i * 20})
    now = await anext(stream)
    assert now.kind == "progress" and now.json()["bytes_done"] == 20
    started = time.monotonic()
    later = await anext(stream)
    # the rest came as one event, with the latest bytes, once the interval was over
    assert later.kind == "progress" and later.json()["bytes_done"] == 1000 and later.seq == now.seq + 1
    assert time.monotonic() - started >= 0.15
    await stream.aclose()
