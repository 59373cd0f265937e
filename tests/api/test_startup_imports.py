"""What the service imports before it answers its first request: the callback client
(httpx, with its command-line extras), the server-sent-events library, the websocket
protocol, the settings fields' source, numpy, the loader's planner, weight index,
header reader and pipeline, and the routes other than the probes' (with their request and
response models) are left until used (checked in a fresh interpreter through
``sys.modules``; the time this saves is shown by bench/startup.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from service.api.settings import Settings, field_docs

ROOT = Path(__file__).resolve().parent.parent.parent

_START = """
import asyncio, json, sys
from pathlib import Path
from service.api.app import create_app
from service.api.settings import Settings

app = create_app(Settings(models_dir=Path(sys.argv[1]), cuda=False))
answers = []
bodies = []

async def get(path, state):
    sent = []
    scope = {"type": "http", "method": "GET", "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": [], "state": dict(state), "app": app, "http_version": "1.1", "scheme": "http",
             "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 9), "root_path": ""}
    async def receive():
        return {"type": "http.request", "body": b""}
    async def send(message):
        sent.append(message)
    await app(scope, receive, send)
    bodies.append(b"".join(m.get("body", b"") for m in sent[1:]).decode())
    return sent[0]["status"]

async def main():
    async with app.router.lifespan_context(app) as state:
        answers.append(await get("/healthz", state))
        answers.append(await get("/readyz", state))
        before = set(sys.modules)
        answers.append(await get(sys.argv[2], state) if len(sys.argv) > 2 else 0)
        return before

before = asyncio.run(main())
print(json.dumps({"answers": answers, "body": bodies[-1], "started": sorted(before), "after": sorted(sys.modules)}))
"""

LATER = {"httpx", "sse_starlette", "rich", "pygments", "numpy", "websockets"}

LOADER = {
    "service.loader.pipeline.load",
    "service.loader.pipeline.worker",
    "service.loader.placement.plan",
    "service.loader.weights",
    "service.loader.gguf.reader",
    "service.loader.model",
    "service.io.touch",
}
"""Modules of the loader a plan or a load imports, and the start does not."""

ROUTES = {
    "service.api.schemas",
    "service.api.event_schema",
    *(f"service.api.routes.{name}" for name in ("loads", "events", "plans", "models", "files", "devices", "metrics")),
}
"""The routes after the probes' and their bodies, built on the first request for them."""


def start(models: Path, *then: str) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-c", _START, str(models), *then], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    return report


def test_ready_without_the_callback_client_or_the_event_stream(tmp_path: Path) -> None:
    report = start(tmp_path)
    assert report["answers"][:2] == [200, 200]
    started = {m.split(".")[0] for m in report["started"]}
    assert "fastapi" in started and "service" in started
    assert not started & LATER
    assert "service.loader.devices" in report["started"]  # the lifespan found the devices
    assert not set(report["started"]) & LOADER
    assert not set(report["started"]) & ROUTES
    assert "service.api.routes.health" in report["started"]


def test_the_first_header_read_imports_what_the_start_left(tmp_path: Path) -> None:
    """Listing the model files after the start reads their headers with the loader's
    modules the start did not import (the deferred imports are made where they are
    used), and summarises them as a service that imported them at once would."""
    from tests.helpers import write_fixture

    write_fixture(tmp_path / "m.gguf", arch="gemma3")
    report = start(tmp_path, "/v1/files")
    assert report["answers"] == [200, 200, 200]
    listed = json.loads(report["body"])["data"]
    assert [(f["path"], f["architecture"], f["error"]) for f in listed] == [("m.gguf", "gemma3", None)]
    assert {"service.loader.weights", "service.loader.gguf.reader"} <= set(report["after"])
    assert ROUTES <= set(report["after"])


def test_the_openapi_document_needs_neither(tmp_path: Path) -> None:
    """The event stream's route is documented (text/event-stream) without its library."""
    report = start(tmp_path, "/openapi.json")
    assert report["answers"] == [200, 200, 200]
    assert not {m.split(".")[0] for m in report["after"]} & LATER
    events = json.loads(report["body"])["paths"]["/v1/loads/{job_id}/events"]["get"]
    assert "text/event-stream" in events["responses"]["200"]["content"]


def test_every_setting_is_documented_without_pydantic_reading_the_source() -> None:
    assert not Settings.model_config.get("use_attribute_docstrings")
    docs = field_docs()
    assert set(docs) == set(Settings.model_fields)
    assert all(docs.values())
    assert "HOIST_MODELS_DIR" in docs["models_dir"]


def test_lazy_packages_export_what_their_modules_define() -> None:
    """The placement, pipeline and GGUF packages give the same objects as their modules
    whichever is imported first; ``placement.plan`` stays the function when the
    submodule of that name is imported (checked in a fresh interpreter)."""
    code = """
import json, sys
import service.loader.placement.plan as first  # the submodule first: the package's name is still the function
from service.loader import gguf, pipeline, placement
from service.loader.gguf import reader, values
from service.loader.pipeline import load, options
import service.loader.placement.buffers, service.loader.placement.params, service.loader.placement.memory
mod = sys.modules["service.loader.placement.plan"]

def same(package):
    return all(getattr(package, n) is getattr(sys.modules[package.__name__ + "." + home], n)
               for n, home in package._HOME.items())

out = {
    "plan_is_function": placement.plan is mod.plan and callable(placement.plan) and first is mod.plan,
    "placement": same(placement),
    "pipeline": same(pipeline),
    "gguf": same(gguf),
    "all": sorted(set(placement.__all__) - set(dir(placement)) - set(placement._HOME)),
}
try:
    placement.nothing
except AttributeError as exc:
    out["missing"] = str(exc)
print(json.dumps(out))
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout.splitlines()[-1])
    assert out["plan_is_function"] and out["placement"] and out["pipeline"] and out["gguf"]
    assert out["all"] == []
    assert "has no attribute 'nothing'" in out["missing"]


def test_the_collector_is_paused_for_the_start_only(tmp_path: Path) -> None:
    """``hoist serve`` imports and builds with the cyclic collector paused, then serves
    with it running and the start's objects frozen out of its passes; a start that
    fails leaves it running too (checked in a fresh interpreter, the server stubbed)."""
    code = """
import gc, json, socket, sys
import uvicorn
from service.cli import main

seen = {}
def run(self, sockets=None):
    seen.update(enabled=gc.isenabled(), frozen=gc.get_freeze_count())
uvicorn.Server.run = run
served = main(["serve", "--models-dir", sys.argv[1], "--port", "0"])
with socket.socket() as busy:
    busy.bind(("127.0.0.1", 0))
    failed = main(["serve", "--models-dir", sys.argv[1], "--port", str(busy.getsockname()[1])])
    seen.update(failed=failed, enabled_after=gc.isenabled())
seen["served"] = served
print(json.dumps(seen))
"""
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    seen = json.loads(result.stdout.splitlines()[-1])
    assert seen["served"] == 0 and seen["failed"] != 0
    assert seen["enabled"] and seen["enabled_after"]
    assert seen["frozen"] > 10_000  # the libraries' and the app's objects
