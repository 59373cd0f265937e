"""The API takes the flag spellings the CLI takes (``dio`` too) and answers with the
canonical names; it refuses the ``n_gpu_layers`` values llama.cpp refuses with a 422."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.test_loads import wait_for
from tests.helpers import block_model


def _without_free(plan: dict[str, Any]) -> dict[str, Any]:
    """``plan`` without the free memory it was planned against (it changes from moment
    to moment on a shared host)."""
    for use in plan["devices_memory"]:
        use.pop("free_bytes")
    return plan


def test_dio_over_the_api(live_server_emu: str, models_dir: Path) -> None:
    block_model(models_dir / "m.gguf", 4)
    with httpx.Client(base_url=live_server_emu) as client:
        enum = client.get("/openapi.json").json()["components"]["schemas"]["PlanRequest"]["properties"]["load_mode"]
        assert "dio" in enum["enum"] and "direct-io" in enum["enum"]
        resp = client.post("/v1/plans", json={"model": "m.gguf", "load_mode": "dio", "n_gpu_layers": 2})
        assert resp.status_code == 200, resp.text
        spelled = client.post("/v1/plans", json={"model": "m.gguf", "load_mode": "direct-io", "n_gpu_layers": 2})
        assert resp.json()["load_mode"] == "direct-io" == resp.json()["effective_load_mode"]
        # the same plan, but for host memory freed or taken by others between the two
        assert _without_free(resp.json()) == _without_free(spelled.json())
        job = client.post("/v1/loads", json={"model": "m.gguf", "load_mode": "dio"})
        assert job.status_code == 202, job.text
        assert job.json()["load_mode"] == "direct-io"
        done = wait_for(client, job.headers["location"], {"succeeded", "failed"})
        assert done["state"] == "succeeded" and done["load_mode"] == "direct-io", done
        bad = client.post("/v1/plans", json={"model": "m.gguf", "load_mode": "DIO"})
        assert bad.status_code == 422 and bad.headers["content-type"].startswith("application/problem+json")
        assert "expected one of: auto, none, mmap, mlock, mmap+mlock, direct-io, dio" in bad.json()["detail"]


@pytest.mark.parametrize(
    ("value", "offloaded"),
    [(-1, 9), (-5, 9), (-(2**31), 9), ("all", 9), ("auto", 9), (0, 0), (3, 3), (2**31 - 1, 9)],
)
def test_n_gpu_layers_as_llama_cpp_takes_it(
    live_server_emu: str, models_dir: Path, value: object, offloaded: int
) -> None:
    block_model(models_dir / "m.gguf", 8)
    with httpx.Client(base_url=live_server_emu) as client:
        resp = client.post("/v1/plans", json={"model": "m.gguf", "n_gpu_layers": value}, params={"tensors": False})
        assert resp.status_code == 200, resp.text
        assert resp.json()["offload_lines"][-1] == f"offloaded {offloaded}/9 layers to GPU"


@pytest.mark.parametrize("value", [2**31, -(2**31) - 1, True, "5", "-5", "ALL", 1.5])
def test_n_gpu_layers_refused_with_422(live_server_emu: str, models_dir: Path, value: object) -> None:
    block_model(models_dir / "m.gguf", 2)
    with httpx.Client(base_url=live_server_emu) as client:
        resp = client.post("/v1/plans", json={"model": "m.gguf", "n_gpu_layers": value})
        assert resp.status_code == 422, resp.text
        assert resp.headers["content-type"].startswith("application/problem+json")
        problem = resp.json()
        assert problem["code"] == "validation_error" and "n_gpu_layers" in problem["detail"]
