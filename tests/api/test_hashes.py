"""Tensor hashes over HTTP: ``hash_tensors`` goes from the request to the load, and
``GET /v1/models/{name}/hashes`` pages the digests, equal to xxh3_64 of gguf-py's bytes;
a model loaded without hashes has none, and a hashed load does not share it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import httpx
import numpy as np
import pytest
import xxhash

from service.api.schemas import LoadRequest
from service.api.spec import check_name
from service.errors import RequestError
from tests.api.test_loads import put, wait_for
from tests.helpers import Fixture


def _expected(path: Path) -> dict[str, str]:
    reader = gguf.GGUFReader(path)
    return {t.name: xxhash.xxh3_64(np.ascontiguousarray(t.data).tobytes()).hexdigest() for t in reader.tensors}


def test_the_request_field_reaches_the_load_options() -> None:
    assert LoadRequest(model="m.gguf", hash_tensors=True).spec().options.hash_tensors is True
    assert LoadRequest(model="m.gguf").spec().options.hash_tensors is False
    with pytest.raises(ValueError):
        LoadRequest(model="m.gguf", hash_tensors="maybe")  # type: ignore[arg-type]


def test_a_name_cannot_end_in_the_hashes_path() -> None:
    with pytest.raises(RequestError, match="/hashes"):
        check_name("org/model/hashes")
    assert check_name("hashes") == "hashes"
    # the readiness path's last part is refused alone too, and the error says so
    with pytest.raises(RequestError, match="is 'ready'"):
        check_name("ready")


@pytest.mark.parametrize("mode", ["mmap", "none"])
def test_hashes_are_listed_in_pages(live_server: str, models_dir: Path, all_types_fixture: Fixture, mode: str) -> None:
    name = put(models_dir, all_types_fixture)
    want = _expected(all_types_fixture.path)
    with httpx.Client(base_url=live_server) as client:
        resp = client.post("/v1/loads", json={"model": name, "load_mode": mode, "hash_tensors": True, "name": "m/x"})
        assert resp.status_code == 202, resp.text
        done = wait_for(client, resp.headers["location"], {"succeeded", "failed", "cancelled"})
        assert done["state"] == "succeeded", done
        assert done["stats"]["stages"]["hash"]["bytes"] == done["bytes_total"]
        got: dict[str, str] = {}
        offset = 0
        while True:
            page = client.get("/v1/models/m/x/hashes", params={"limit": 5, "offset": offset})
            assert page.status_code == 200, page.text
            body = page.json()
            assert body["algorithm"] == "xxh3_64" and body["name"] == "m/x" and body["total"] == len(want)
            assert len(body["data"]) <= 5
            got.update({row["name"]: row["xxh3_64"] for row in body["data"]})
            offset += 5
            if offset >= body["total"]:
                break
        assert got == want
        # the model is still reachable by its name; DELETE of the hashes path unloads nothing
        assert client.delete("/v1/models/m/x/hashes").status_code in (404, 405)
        assert client.get("/v1/models/m/x").status_code == 200


def test_no_hashes_without_the_field_and_no_sharing(
    live_server: str, models_dir: Path, all_types_fixture: Fixture
) -> None:
    name = put(models_dir, all_types_fixture)
    with httpx.Client(base_url=live_server) as client:
        resp = client.post("/v1/loads", json={"model": name, "load_mode": "none"})
        done = wait_for(client, resp.headers["location"], {"succeeded", "failed", "cancelled"})
        assert done["state"] == "succeeded", done
        assert "hash" not in done["stats"]["stages"]
        missing = client.get(f"/v1/models/{name}/hashes")
        assert missing.status_code == 404 and "hash_tensors" in missing.json()["detail"]
        # a hashed load of the same model under its name does not share the unhashed copy
        again = client.post("/v1/loads", json={"model": name, "load_mode": "none", "hash_tensors": True})
        assert again.status_code == 409 and "hash_tensors" in again.json()["detail"]
        other = client.post("/v1/loads", json={"model": name, "load_mode": "none", "hash_tensors": True, "name": "h"})
        job = wait_for(client, other.headers["location"], {"succeeded", "failed", "cancelled"})
        assert job["state"] == "succeeded" and not job["shared"]
        assert client.get("/v1/models/h/hashes").json()["total"] == len(all_types_fixture.tensors)


def test_the_cli_prints_hashes_as_json(all_types_fixture: Fixture) -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "service.cli",
            "load",
            "--json",
            "--hash-tensors",
            "-lm",
            "none",
            str(all_types_fixture.path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    data = json.loads(run.stdout)
    assert data["tensor_hashes"] == {"algorithm": "xxh3_64", "tensors": _expected(all_types_fixture.path)}
