"""``hoist watch JOB_ID`` follows a load of a real server to its end."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.api.test_events import BODY, TOKEN, _settings
from tests.conftest import _serve

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def token_server(models_dir: Path) -> Iterator[str]:
    yield from _serve(_settings(models_dir, api_token=TOKEN))


def _watch(url: str, job_id: str, token: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOIST_")}
    env.update({"PYTHONPATH": str(ROOT), "COLUMNS": "200", **({"HOIST_API_TOKEN": token} if token else {})})
    return subprocess.run(
        [sys.executable, "-m", "service.cli", "watch", job_id, "--url", url],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )


def test_watch_follows_a_load_to_its_report(token_server: str) -> None:
    auth = {"authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=token_server, headers=auth, timeout=30) as client:
        job_id = client.post("/v1/loads", json=BODY).json()["id"]
        run = _watch(token_server, job_id, TOKEN)
        assert run.returncode == 0, run.stderr
        job = client.get(f"/v1/loads/{job_id}").json()
    assert job["state"] == "succeeded"  # watch returned once the job ended
    # the offload lines and the memory report, as the job itself gives them
    offload = [line for line in job["plan"]["lines"] if "model buffer size" not in line]
    assert offload and run.stdout.splitlines() == offload + job["memory"]["lines"]  # buffer lines once
    assert f"as {job_id} in " in run.stderr and "loading m.gguf" in run.stderr
    refused = _watch(token_server, job_id, None)
    assert refused.returncode == 1 and "refused (401)" in refused.stderr
    unknown = _watch(token_server, "lj_nope", TOKEN)
    assert unknown.returncode == 1 and "refused (404)" in unknown.stderr and "lj_nope" in unknown.stderr
    assert len(refused.stderr.splitlines()) == len(unknown.stderr.splitlines()) == 1  # no bar before the refusal
