"""Webhooks against a real ``hoist serve`` and real receivers on 127.0.0.1: the events of
a load arrive in order and signed, receivers that fail, hang or are down cost the load
nothing and are counted, and URLs the allow-list does not admit are refused."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.api.callback_policy import AllowList
from service.api.callbacks import backoff, sign
from service.api.event_schema import LoadEvent
from service.errors import CallbackRefusedError
from tests.api.test_events import EMBD_BYTES, LAYER_BYTES, _model
from tests.conftest import ServeProcess, _free_port

SECRET = "whsec-test-0123456789"
TOTAL = 2 * EMBD_BYTES + 2 * LAYER_BYTES
REPLAY_WINDOW_S = 300


class Receiver:
    """An HTTP server on 127.0.0.1 that records the callbacks it gets and answers as
    ``mode`` says: ``ok`` (204), ``fail`` (500), ``hang`` (never answers until closed),
    ``redirect`` (307 to ``location``)."""

    def __init__(self, mode: str, location: str = "") -> None:
        self.mode = mode
        self.location = location
        self.got: list[tuple[dict[str, str], bytes]] = []
        self.released = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                receiver.got.append(({k.lower(): v for k, v in self.headers.items()}, body))
                if receiver.mode == "hang":
                    receiver.released.wait(30)
                    return
                if receiver.mode == "redirect":
                    self.send_response(307)
                    self.send_header("Location", receiver.location)
                elif receiver.mode == "fail":
                    self.send_response(500)
                else:
                    self.send_response(204)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook?token=abc"

    def close(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receivers() -> Iterator[Callable[..., Receiver]]:
    made: list[Receiver] = []

    def make(mode: str, location: str = "") -> Receiver:
        made.append(Receiver(mode, location))
        return made[-1]

    yield make
    for r in made:
        r.close()


_names = itertools.count()


def _load(server: ServeProcess, callback: dict[str, Any] | None = None) -> dict[str, Any]:
    """Submit a load (a fresh name, unloaded once loaded: nothing is shared) and wait for
    it to end; returns the ended job."""
    body: dict[str, Any] = {
        "model": "m.gguf",
        "name": f"m{next(_names)}",
        "keep_alive": 0,
        "load_mode": "none",
        "n_gpu_layers": 99,
        "staging_buffers": 1,
        "staging_size": 256 << 10,
    }
    if callback is not None:
        body["callback"] = callback
    r = httpx.post(f"{server.url}/v1/loads", json=body, timeout=30)
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        job: dict[str, Any] = httpx.get(f"{server.url}/v1/loads/{job_id}", timeout=10).json()
        if job["state"] in ("succeeded", "failed", "cancelled"):
            assert job["state"] == "succeeded", job
            return job
        time.sleep(0.05)
    raise AssertionError(f"load {job_id} did not end")


def _settled(server: ServeProcess, job_id: str, timeout_s: float = 30) -> dict[str, Any]:
    """The job's callback status once its sender ended."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status: dict[str, Any] = httpx.get(f"{server.url}/v1/loads/{job_id}", timeout=10).json()["callback"]
        if status["done"]:
            return status
        time.sleep(0.1)
    raise AssertionError(f"the callback of {job_id} did not end: {status}")


def _load_time(job: dict[str, Any]) -> float:
    return (datetime.fromisoformat(job["finished_at"]) - datetime.fromisoformat(job["started_at"])).total_seconds()


def _verify(secret: str, header: str, body: bytes, now: float) -> bool:
    """What a receiver does: parse ``t=..,v1=..``, refuse a timestamp outside the replay
    window, compare the HMAC in constant time."""
    fields = dict(part.split("=", 1) for part in header.split(","))
    t = int(fields["t"])
    if abs(now - t) > REPLAY_WINDOW_S:
        return False
    expected = hmac.new(secret.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, fields["v1"])


@pytest.fixture
def serve(hoist_serve: Callable[..., ServeProcess], models_dir: Path) -> Callable[..., ServeProcess]:
    _model(models_dir / "m.gguf")

    def start(**env: str) -> ServeProcess:
        settings = {
            # 4 MiB at 4 MiB/s: about a second of load
            "HOIST_EMULATED_DEVICES": "EMU0=64MiB:bandwidth=4MiB",
            "HOIST_CALLBACK_HOSTS": "127.0.0.1",
            "HOIST_CALLBACK_SECRET": SECRET,
            "HOIST_CALLBACK_TIMEOUT_S": "0.5",
            "HOIST_CALLBACK_RETRY_S": "1.5",
            **env,
        }
        return hoist_serve(**settings)

    return start


def test_events_arrive_in_order_and_signed(serve: Callable[..., ServeProcess], receivers: Any) -> None:
    server = serve()
    receiver = receivers("ok")
    job = _load(server, {"url": receiver.url, "min_interval_s": 0.2})
    status = _settled(server, job["id"])
    got = receiver.got
    assert status["delivered"] == len(got) and status["dropped"] == 0 and status["retried"] == 0, status
    assert status["last_status"] == 204 and status["last_error"] is None
    assert status["target"] == receiver.url.split("/hook")[0]  # no path or query shown
    events = [json.loads(body) for _, body in got]
    for (headers, body), event in zip(got, events, strict=True):
        LoadEvent.model_validate(event)
        assert headers["content-type"] == "application/json"
        assert headers["hoist-event"] == event["event"] and headers["hoist-seq"] == str(event["seq"])
        assert headers["hoist-job"] == job["id"] == event["job_id"]
        assert _verify(SECRET, headers["hoist-signature"], body, time.time())
        # a changed body, or the same request replayed after the window, is refused
        assert not _verify(SECRET, headers["hoist-signature"], body + b" ", time.time())
        assert not _verify(SECRET, headers["hoist-signature"], body, time.time() + REPLAY_WINDOW_S + 10)
    kinds = [e["event"] for e in events]
    assert kinds[0] == "state" and events[0]["state"] == "running"
    assert kinds[-2:] == ["state", "report"] and events[-1]["final"] is True
    assert events[-1]["bytes_done"] == TOTAL and events[-1]["report"]["model_id"] == job["id"]
    assert "progress" in kinds and "snapshot" not in kinds and "heartbeat" not in kinds
    seqs = [e["seq"] for e in events]
    assert seqs == sorted(set(seqs)), seqs
    done = [e["bytes_done"] for e in events]
    assert done == sorted(done)
    # progress no more often than min_interval_s (the hub sends about ten a second)
    times = [datetime.fromisoformat(e["time"]) for e in events if e["event"] == "progress"]
    assert all((b - a).total_seconds() >= 0.15 for a, b in itertools.pairwise(times)), times

    # only the types asked for
    only = receivers("ok")
    job = _load(server, {"url": only.url, "events": ["report"]})
    assert _settled(server, job["id"])["delivered"] == 1
    assert [json.loads(b)["event"] for _, b in only.got] == ["report"]


def test_failing_hanging_and_down_receivers_cost_the_load_nothing(
    serve: Callable[..., ServeProcess], receivers: Any
) -> None:
    server = serve()
    baseline = _load_time(_load(server))
    down = f"http://127.0.0.1:{_free_port()}/hook"  # nothing listens there
    failing, hanging = receivers("fail"), receivers("hang")
    for url, mode in ((failing.url, "fail"), (hanging.url, "hang"), (down, "down")):
        job = _load(server, {"url": url, "min_interval_s": 0})
        took = _load_time(job)
        assert took < baseline * 1.5 + 0.5, (mode, took, baseline)
        status = _settled(server, job["id"])
        assert status["delivered"] == 0, (mode, status)
        assert status["retried"] >= 1 and status["dropped"] >= 2, (mode, status)
        assert status["last_error"], (mode, status)
        if mode == "fail":
            assert status["last_status"] == 500 and "500" in status["last_error"]
            # every attempt reached the receiver: one per event tried, one per retry
            tried = {json.loads(body)["seq"] for _, body in failing.got}
            assert len(failing.got) == len(tried) + status["retried"], status
        elif mode == "hang":
            assert "timed out" in status["last_error"]
        else:
            assert status["last_status"] is None
    # a server stopped while a sender waits on a hanging receiver stops promptly: the
    # senders are cancelled and awaited
    job = _load(server, {"url": hanging.url})
    assert not httpx.get(f"{server.url}/v1/loads/{job['id']}", timeout=10).json()["callback"]["done"]
    stopping = time.monotonic()
    server.proc.terminate()
    server.proc.wait(timeout=20)
    assert time.monotonic() - stopping < 5
    output = server.output()
    assert "Traceback" not in output and "was destroyed but it is pending" not in output, output


def test_refused_urls(serve: Callable[..., ServeProcess], receivers: Any) -> None:
    server = serve()
    port = _free_port()
    refused = [
        f"http://10.0.0.1:{port}/hook",  # outside the allow-list
        "http://example.com/hook",
        f"http://127.0.0.2:{port}/hook",
        f"http://user:pass@127.0.0.1:{port}/hook",  # credentials
        f"http://user@127.0.0.1:{port}/hook",
        f"ftp://127.0.0.1:{port}/hook",  # not http
        "file:///etc/passwd",
        f"http://127.0.0.1:{port}/" + "a" * 3000,  # too long
        "http:///hook",
    ]
    for url in refused:
        r = httpx.post(f"{server.url}/v1/loads", json={"model": "m.gguf", "callback": {"url": url}}, timeout=30)
        assert r.status_code in (400, 422), (url, r.text)
        assert r.headers["content-type"] == "application/problem+json"
        if r.status_code == 400:
            assert r.json()["code"] == "callback_refused", r.text
    assert httpx.get(f"{server.url}/v1/loads", timeout=10).json()["total"] == 0

    # a redirect is not followed: it fails at once, and its target gets nothing
    elsewhere = receivers("ok")
    redirecting = receivers("redirect", location=elsewhere.url)
    job = _load(server, {"url": redirecting.url, "events": ["state", "report"]})
    status = _settled(server, job["id"])
    assert status["delivered"] == 0 and status["retried"] == 0 and status["dropped"] == 3, status
    assert status["last_status"] == 307 and "redirect" in status["last_error"]
    assert len(redirecting.got) == 3 and elsewhere.got == []


def test_callbacks_refused_when_no_host_is_allowed(serve: Callable[..., ServeProcess]) -> None:
    server = serve(HOIST_CALLBACK_HOSTS="")
    r = httpx.post(
        f"{server.url}/v1/loads", json={"model": "m.gguf", "callback": {"url": "http://127.0.0.1:9/x"}}, timeout=30
    )
    assert r.status_code == 400 and r.json()["code"] == "callback_refused", r.text
    assert r.headers["content-type"] == "application/problem+json"


# -- the allow-list and signature on their own -----------------------------------------


def test_allow_list_names_networks_and_resolution() -> None:
    allow = AllowList("hooks.example.com, *.corp.example, 10.1.0.0/16, ::1")
    assert allow.check_url("https://hooks.example.com/x").port == 443
    assert allow.check_url("http://a.b.corp.example:8080/x").host_header == "a.b.corp.example:8080"
    assert allow.check_url("http://10.1.2.3/x").host == "10.1.2.3"
    assert allow.check_url("http://[::1]:9/x").origin == "http://[::1]:9"
    for url in (
        "http://corp.example/x",  # the wildcard is for names under it
        "http://hooks.example.com.evil.test/x",
        "http://10.2.0.1/x",
        "http://[::2]/x",
        "gopher://hooks.example.com/x",
        "http://u:p@hooks.example.com/x",
        "http://hooks.example.com:99999/x",
        "http://hooks.example.com:0/x",  # not "the default port"
        "http://hooks.example.com/a b",
    ):
        with pytest.raises(CallbackRefusedError):
            allow.check_url(url)
    with pytest.raises(CallbackRefusedError, match="not enabled"):
        AllowList("").check_url("http://10.1.2.3/x")
    with pytest.raises(ValueError):
        AllowList("10.0.0.0/33")
    with pytest.raises(ValueError):
        AllowList("bad host!")

    # a name listed that resolves into a network not listed is refused when delivering
    # (loopback here: "localhost" is allowed by name, 127.0.0.0/8 is not listed)
    by_name = AllowList("localhost")
    target = by_name.check_url("http://localhost:9/x")
    with pytest.raises(CallbackRefusedError, match="not allowed"):
        asyncio.run(by_name.resolve(target))
    # with its network listed, the address checked is the one connected to
    both = AllowList("localhost,127.0.0.0/8,::1")
    assert str(asyncio.run(both.resolve(both.check_url("http://localhost:9/x")))) in ("127.0.0.1", "::1")
    # an IPv4-mapped IPv6 address is checked as the IPv4 address it maps
    assert not AllowList("10.0.0.0/8").address_allowed(ipaddress.ip_address("::ffff:127.0.0.1"), by_name=True)
    assert AllowList("127.0.0.0/8").address_allowed(ipaddress.ip_address("::ffff:127.0.0.1"), by_name=False)


def test_signature_and_backoff() -> None:
    body = b'{"event":"report"}'
    header = sign(SECRET.encode(), body, 1_700_000_000)
    # computed independently: HMAC-SHA256 over "<t>.<body>"
    mac = hmac.new(SECRET.encode(), b"1700000000." + body, hashlib.sha256).hexdigest()
    assert header == f"t=1700000000,v1={mac}"
    delays = [backoff(n) for n in range(1, 12)]
    assert 0.125 <= delays[0] <= 0.25 and all(d <= 10.0 for d in delays)
    assert delays[4] >= 2.0  # grows: the fifth retry waits at least half of 4 s


async def test_receivers_that_hang_hold_only_their_share_of_the_slots() -> None:
    from service.api.callbacks import MAX_CONCURRENT_DELIVERIES, MAX_PER_TARGET, Callbacks
    from service.api.events import EventHub

    allow = AllowList("127.0.0.1/32, 127.0.0.2/32")
    sender = Callbacks(EventHub("."), allow)
    hanging = allow.check_url("http://127.0.0.1:9/hang")
    other = allow.check_url("http://127.0.0.2:9/ok")
    release = asyncio.Event()
    inside = 0

    async def hang() -> None:
        nonlocal inside
        async with sender._slot(hanging):
            inside += 1
            await release.wait()

    tasks = [asyncio.create_task(hang()) for _ in range(3 * MAX_CONCURRENT_DELIVERIES)]
    await asyncio.sleep(0.05)
    assert inside == MAX_PER_TARGET  # the rest wait for the hanging target, not for everyone
    async with asyncio.timeout(1):
        async with sender._slot(other):
            pass  # another receiver is served at once
    release.set()
    await asyncio.gather(*tasks)
    assert inside == 3 * MAX_CONCURRENT_DELIVERIES and not sender._per_target
