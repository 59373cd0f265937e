"""What the service imports before it answers its first request: the callback client
(httpx, with its command-line extras), the server-sent-events library and the settings
fields' source are left until used (checked in a fresh interpreter through
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

LATER = {"httpx", "sse_starlette", "rich", "pygments"}


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
