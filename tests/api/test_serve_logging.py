"""``hoist serve --log-level`` sets the level of hoist's own loggers as well as the
server's: below it nothing is logged, from it on everything is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import httpx
import numpy as np

from tests.api.test_loads import wait_for
from tests.conftest import ServeProcess
from tests.helpers import write_fixture

STARTED = "serving models from"  # logged at INFO as the service starts
LOADED = "loaded nan.gguf"  # INFO, once a load succeeds


def _load_twice(server: ServeProcess) -> None:
    """A load that fails its tensor check (a WARNING), then one that succeeds (an INFO)."""
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for check in (True, False):
            resp = client.post("/v1/loads", json={"model": "nan.gguf", "check_tensors": check})
            assert resp.status_code == 202, resp.text
            job = wait_for(client, resp.headers["location"], {"succeeded", "failed"})
            assert job["state"] == ("failed" if check else "succeeded"), job


def _logged(server: ServeProcess, text: str) -> bool:
    return text in " ".join(server.output().split())


def test_the_log_level_applies_to_hoists_loggers(hoist_serve: Any, models_dir: Path) -> None:
    data = np.ones(64, dtype=np.float32)
    data[3] = np.nan
    write_fixture(models_dir / "nan.gguf", tensors={"w": (data, gguf.GGMLQuantizationType.F32)})
    quiet: ServeProcess = hoist_serve(args=["--log-level", "warning"])
    chatty: ServeProcess = hoist_serve(args=["--log-level", "info"])
    for server in (quiet, chatty):
        _load_twice(server)
        assert "of nan.gguf failed" in " ".join(server.output().split()), server.output()
    for text in (STARTED, LOADED):
        assert not _logged(quiet, text), quiet.output()
        assert _logged(chatty, text), chatty.output()
    silent: ServeProcess = hoist_serve(args=["--log-level", "error"])
    _load_twice(silent)
    assert "nan.gguf" not in silent.output(), silent.output()
