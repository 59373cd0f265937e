"""The real service over HTTP: start a load, follow it, read the report and devices;
bad requests and bad files get a 4xx problem; the service stays healthy."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.loader.pipeline.worker import Worker
from tests.helpers import Fixture, write_fixture
from tests.samples import tensor_data_span


def wait_for(client: httpx.Client, location: str, states: set[str], timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        job: dict[str, Any] = client.get(location).json()
        if job["state"] in states:
            return job
        if time.monotonic() > deadline:
            raise AssertionError(f"job stayed {job['state']}: {job}")
        time.sleep(0.02)


def put(models_dir: Path, fx: Fixture | Path, name: str | None = None) -> str:
    src = fx.path if isinstance(fx, Fixture) else fx
    dest = models_dir / (name or src.name)
    try:
        os.link(src, dest)
    except OSError:
        shutil.copyfile(src, dest)
    return dest.name


@pytest.mark.parametrize("mode", ["mmap", "none"])
def test_load_a_fixture_end_to_end(live_server: str, models_dir: Path, all_types_fixture: Fixture, mode: str) -> None:
    name = put(models_dir, all_types_fixture)
    with httpx.Client(base_url=live_server) as client:
        resp = client.post("/v1/loads", json={"model": name, "load_mode": mode})
        assert resp.status_code == 202, resp.text
        job = resp.json()
        assert resp.headers["location"] == f"/v1/loads/{job['id']}"
        assert job["state"] in ("queued", "running", "succeeded")
        assert job["bytes_total"] == sum(d.nbytes for d, _ in all_types_fixture.tensors.values())
        done = wait_for(client, resp.headers["location"], {"succeeded", "failed", "cancelled"})
        assert done["state"] == "succeeded", done
        assert done["bytes_done"] == done["bytes_total"] and done["progress"] == 1.0
        memory = done["memory"]
        buffer_type = "CPU_Mapped" if mode == "mmap" else "CPU"
        assert {b["buffer_type"] for b in memory["buffers"]} == {buffer_type}
        # buffers hold the tensor bytes, plus at most the alignment padding between them
        n = len(all_types_fixture.tensors)
        assert done["bytes_total"] <= memory["total_bytes"] <= done["bytes_total"] + 32 * n
        devices = client.get("/v1/devices").json()["data"]
        cpu = next(d for d in devices if d["name"] == "CPU")
        assert cpu["total_bytes"] >= cpu["free_bytes"] > 0
        use = next(u for u in cpu["models"] if u["model_id"] == done["model_id"])
        assert use["buffer_types"] == {buffer_type: memory["total_bytes"]}
        models = client.get("/v1/models").json()["data"]
        assert [m["id"] for m in models] == [done["model_id"]]
        assert client.delete(f"/v1/models/{done['model_id']}").status_code == 200
        assert client.get("/v1/models").json()["data"] == []
        assert client.get("/v1/devices").json()["data"][0]["models"] == []


@pytest.mark.sample
def test_load_the_sample_over_http(live_server: str, models_dir: Path, sample_path: Path, sample_reader: Any) -> None:
    put(models_dir, sample_path)
    span = tensor_data_span(sample_reader)  # one mapped range over all tensor data
    with httpx.Client(base_url=live_server) as client:
        resp = client.post("/v1/loads", json={"model": sample_path.name})
        assert resp.status_code == 202
        done = wait_for(client, resp.headers["location"], {"succeeded", "failed"})
        assert done["state"] == "succeeded", done
        assert done["n_tensors"] == len(sample_reader.tensors)
        assert done["memory"]["total_bytes"] == done["bytes_total"] == span
        assert done["memory"]["lines"] == [f"  CPU_Mapped model buffer size = {span / (1 << 20):8.2f} MiB"]


def test_the_service_answers_while_a_load_runs(
    live_server: str, models_dir: Path, all_types_fixture: Fixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = threading.Event()
    entered = threading.Event()
    real_work = Worker._work

    def gated(self: Worker) -> None:
        entered.set()
        assert gate.wait(30)
        real_work(self)

    monkeypatch.setattr(Worker, "_work", gated)
    name = put(models_dir, all_types_fixture)
    with httpx.Client(base_url=live_server, timeout=5) as client:
        location = client.post("/v1/loads", json={"model": name}).headers["location"]
        assert entered.wait(10)
        # the load is blocked inside its worker: the service still answers
        assert client.get(location).json()["state"] == "running"
        assert client.get("/healthz").json() == {"status": "ok"}
        assert client.get("/v1/devices").status_code == 200
        gate.set()
        assert wait_for(client, location, {"succeeded", "failed"})["state"] == "succeeded"


def test_cancel_a_running_load(
    live_server: str, models_dir: Path, all_types_fixture: Fixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = threading.Event()
    real_work = Worker._work

    def gated(self: Worker) -> None:
        gate.set()
        self.cancel.wait(30)
        real_work(self)

    monkeypatch.setattr(Worker, "_work", gated)
    name = put(models_dir, all_types_fixture)
    with httpx.Client(base_url=live_server, timeout=5) as client:
        location = client.post("/v1/loads", json={"model": name}).headers["location"]
        assert gate.wait(10)
        resp = client.post(f"{location}/cancel")
        assert resp.status_code == 202 and resp.json()["cancel_requested"] is True
        assert wait_for(client, location, {"succeeded", "failed", "cancelled"})["state"] == "cancelled"
        again = client.post(f"{location}/cancel")
        assert again.status_code == 409
        assert again.headers["content-type"].startswith("application/problem+json")
        assert client.get("/v1/models").json()["data"] == []


def _bad_files(tmp_path: Path, good: Path) -> dict[str, tuple[bytes, str]]:
    data = good.read_bytes()
    return {
        "magic.gguf": (b"GGML" + data[4:], "expected 'GGUF'"),
        "truncated_header.gguf": (data[:40], "cannot fit"),
        "past_eof.gguf": (data[:-1], "past the end of the file"),
    }


def test_bad_files_get_a_4xx_and_the_service_stays_healthy(
    live_server: str, models_dir: Path, tmp_path: Path, all_types_fixture: Fixture
) -> None:
    with httpx.Client(base_url=live_server) as client:
        for name, (raw, phrase) in _bad_files(tmp_path, all_types_fixture.path).items():
            (models_dir / name).write_bytes(raw)
            resp = client.post("/v1/loads", json={"model": name})
            assert resp.status_code == 422, resp.text
            assert resp.headers["content-type"].startswith("application/problem+json")
            body = resp.json()
            assert phrase in body["detail"] and name in body["detail"]
            assert body["status"] == 422 and body["code"]
        assert client.get("/healthz").status_code == 200
        # and a good file still loads afterwards
        good = put(models_dir, all_types_fixture)
        location = client.post("/v1/loads", json={"model": good}).headers["location"]
        assert wait_for(client, location, {"succeeded", "failed"})["state"] == "succeeded"


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"model": "missing.gguf"}, 404, "model_not_found"),
        ({"model": "../outside.gguf"}, 400, "invalid_request"),
        ({"model": "/etc/passwd"}, 400, "invalid_request"),
        ({"model": "x.gguf", "load_mode": "fast"}, 422, "validation_error"),
        ({"model": "x.gguf", "surprise": 1}, 422, "validation_error"),
        ({}, 422, "validation_error"),
    ],
)
def test_bad_requests(live_server: str, models_dir: Path, body: dict[str, Any], status: int, code: str) -> None:
    (models_dir.parent / "outside.gguf").write_bytes(b"GGUF")
    with httpx.Client(base_url=live_server) as client:
        resp = client.post("/v1/loads", json=body)
        assert resp.status_code == status, resp.text
        assert resp.json()["code"] == code
        assert client.get("/v1/loads/lj_nope").status_code == 404
        assert client.get("/healthz").status_code == 200


def test_symlink_out_of_the_models_dir_is_refused(live_server: str, models_dir: Path, tmp_path: Path) -> None:
    target = write_fixture(tmp_path / "elsewhere.gguf").path
    (models_dir / "link.gguf").symlink_to(target)
    with httpx.Client(base_url=live_server) as client:
        resp = client.post("/v1/loads", json={"model": "link.gguf"})
        assert resp.status_code == 400 and "leaves the models directory" in resp.json()["detail"]


def test_split_model_over_http(live_server: str, models_dir: Path, all_types_fixture: Fixture) -> None:
    from tests.helpers import split_gguf

    paths = split_gguf(all_types_fixture.path, models_dir / "m", [2, 2, 3])
    with httpx.Client(base_url=live_server) as client:
        resp = client.post("/v1/loads", json={"model": paths[0].name, "load_mode": "none"})
        assert resp.status_code == 202, resp.text
        done = wait_for(client, resp.headers["location"], {"succeeded", "failed"})
        assert done["state"] == "succeeded" and done["n_tensors"] == 7
        resp = client.post("/v1/loads", json={"model": paths[1].name})
        assert resp.status_code == 422 and "first split" in resp.json()["detail"]
        assert resp.json()["code"] == "invalid_split"


@pytest.mark.parametrize(
    ("raw_json", "status"),
    [
        ('{"model": "bad\\udcff.gguf"}', 422),  # a lone surrogate: not a UTF-8 string
        ('{"model": "\\ud800"}', 422),
        ('{"model": "x.gguf/"}', 400),
        ('{"model": ""}', 422),  # empty: refused by the schema
        ('{"model": "' + "a/../" * 1000 + 'x.gguf"}', 422),  # over 4096 bytes
        ('{"model": "' + "a/" * 1000 + 'x.gguf"}', 404),  # 2006 bytes, resolved off the event loop
        ('{"model": "x.gguf"', 422),  # malformed JSON
    ],
)
def test_unusable_paths_are_4xx(live_server: str, models_dir: Path, raw_json: str, status: int) -> None:
    (models_dir / "x.gguf").write_bytes(b"GGUF")
    with httpx.Client(base_url=live_server) as client:
        resp = client.post("/v1/loads", content=raw_json, headers={"content-type": "application/json"})
        assert resp.status_code == status, resp.text
        assert resp.headers["content-type"].startswith("application/problem+json")
        for path in ("/v1/loads", "/v1/models", "/v1/devices", "/healthz"):
            assert client.get(path).status_code == 200


def test_errors_do_not_reveal_the_models_dir(live_server: str, models_dir: Path, all_types_fixture: Fixture) -> None:
    (models_dir / "cut.gguf").write_bytes(all_types_fixture.path.read_bytes()[:-1])
    with httpx.Client(base_url=live_server) as client:
        resp = client.post("/v1/loads", json={"model": "cut.gguf"})
        assert resp.status_code == 422
        assert str(models_dir) not in resp.text and str(models_dir.resolve()) not in resp.text
        assert resp.json()["detail"].startswith("cut.gguf: ")


def test_symlinked_splits_inside_the_models_dir(live_server: str, models_dir: Path, all_types_fixture: Fixture) -> None:
    """A Hugging Face cache: split names are links to content-addressed blobs."""
    from tests.helpers import split_gguf

    blobs = models_dir / "blobs"
    snap = models_dir / "snap"
    blobs.mkdir()
    snap.mkdir()
    for i, part in enumerate(split_gguf(all_types_fixture.path, blobs / "x", [3, 4])):
        blob = blobs / f"sha256-{i}"
        part.rename(blob)
        (snap / part.name).symlink_to(Path("..") / "blobs" / blob.name)
    with httpx.Client(base_url=live_server) as client:
        resp = client.post("/v1/loads", json={"model": "snap/x-00001-of-00002.gguf"})
        assert resp.status_code == 202, resp.text
        assert wait_for(client, resp.headers["location"], {"succeeded", "failed"})["state"] == "succeeded"


def test_a_file_name_that_is_not_utf8_behind_a_link(live_server: str, models_dir: Path) -> None:
    target = os.fsencode(models_dir) + b"/bad\xff.gguf"
    with open(target, "wb") as f:
        f.write(b"not a gguf file at all, but long enough")
    (models_dir / "link.gguf").symlink_to(os.fsdecode(target))
    with httpx.Client(base_url=live_server) as client:
        resp = client.post("/v1/loads", json={"model": "link.gguf"})
        assert resp.status_code == 422
        assert resp.json()["code"] == "not_gguf"
        assert client.get("/v1/loads").status_code == 200
