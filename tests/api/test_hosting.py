"""Hosting models by name against a real ``hoist serve``: the model repository listing,
names, shared loads with reference counts, keep-alive, eviction, preloading and
readiness."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import gguf
import httpx
import pytest
from gguf import GGUFValueType as V

from service.api.keepalive import FOREVER, parse_keep_alive
from service.errors import RequestError
from tests.api.test_hostile import ENDED, _device_model, is_problem
from tests.api.test_loads import wait_for
from tests.conftest import ServeProcess
from tests.helpers import block_model, mixed_tensors, split_gguf, write_fixture

MiB = 1 << 20


def _emu(client: httpx.Client) -> dict[str, Any]:
    device: dict[str, Any] = next(d for d in client.get("/v1/devices").json()["data"] if d["name"] == "EMU0")
    return device


def _wait_gone(client: httpx.Client, ref: str, timeout: float = 20) -> float:
    """Seconds until ``GET /v1/models/{ref}`` answers 404."""
    start = time.monotonic()
    while client.get(f"/v1/models/{ref}").status_code != 404:
        assert time.monotonic() - start < timeout, f"model {ref} stayed resident"
        time.sleep(0.05)
    return time.monotonic() - start


# -- keep_alive durations, as Go's time.ParseDuration and Ollama read them -------------------


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (300, 300.0),
        (2.5, 2.5),
        ("0", 0.0),
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("1.5h", 5400.0),
        ("300ms", 0.3),
        ("2h45m10.5s", 9910.5),
        ("90", 90.0),
        (-1, FOREVER),
        ("-1m", FOREVER),
        (-0.001, FOREVER),
    ],
)
def test_keep_alive_durations(value: object, seconds: float) -> None:
    assert parse_keep_alive(value) == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["", "5x", "m", "1h-5m", "inf", "nan", True, [1], 1e12, "9" * 65])
def test_keep_alive_refusals(value: object) -> None:
    with pytest.raises(RequestError, match="keep_alive"):
        parse_keep_alive(value)


# -- the model repository --------------------------------------------------------------------


def test_files_are_listed_with_a_summary_in_pages(hoist_serve: Any, models_dir: Path, tmp_path: Path) -> None:
    write_fixture(
        models_dir / "a.gguf", kv=[("general.file_type", 7, V.UINT32, None)], tensors=mixed_tensors(0), arch="qwen2"
    )
    source = block_model(tmp_path / "whole.gguf", 3)
    splits = split_gguf(source, models_dir / "s", [4, 5])
    (models_dir / "sub").mkdir()
    block_model(models_dir / "sub" / "c.gguf", 2, arch="gemma3")
    (models_dir / "bad.gguf").write_bytes(b"GGUF" + b"\xff" * 60)
    (models_dir / "notes.txt").write_text("not a model")
    outside = block_model(tmp_path / "outside.gguf", 1)
    (models_dir / "link.gguf").symlink_to(outside)
    server: ServeProcess = hoist_serve()
    expected = ["a.gguf", "bad.gguf", "link.gguf", "s-00001-of-00002.gguf", "sub/c.gguf"]
    with httpx.Client(base_url=server.url, timeout=30) as client:
        listing = client.get("/v1/files").json()
        assert [f["path"] for f in listing["data"]] == expected
        assert listing["total"] == len(expected) and listing["truncated"] is False
        files = {f["path"]: f for f in listing["data"]}

        # each summary against gguf-py's reading of the same files
        for rel, paths in (("a.gguf", [models_dir / "a.gguf"]), ("s-00001-of-00002.gguf", splits)):
            readers = [gguf.GGUFReader(p) for p in paths]
            listed = files[rel]
            assert listed["error"] is None
            assert listed["n_tensors"] == sum(len(r.tensors) for r in readers)
            assert listed["n_params"] == sum(int(t.n_elements) for r in readers for t in r.tensors)
            assert listed["size_bytes"] == sum(os.path.getsize(p) for p in paths)
            assert listed["n_splits"] == len(paths)
            arch = readers[0].get_field("general.architecture")
            assert listed["architecture"] == bytes(arch.parts[arch.data[0]]).decode()
        assert files["a.gguf"]["file_type"] == 7 and files["a.gguf"]["file_type_name"] == "Q8_0"
        assert files["sub/c.gguf"]["architecture"] == "gemma3"
        # without general.file_type, llama.cpp guesses from the most common tensor type
        assert files["sub/c.gguf"]["file_type"] is None and files["sub/c.gguf"]["file_type_name"] == "all F32 (guessed)"

        bad = files["bad.gguf"]
        assert bad["error"]["code"] and bad["error"]["code"] != "internal_error", bad
        assert "bad.gguf" in bad["error"]["message"] and str(models_dir) not in bad["error"]["message"]
        assert bad["size_bytes"] == 64 and bad["n_tensors"] is None
        link = files["link.gguf"]
        assert link["error"]["code"] == "invalid_request" and "leaves the models directory" in link["error"]["message"]

        page = client.get("/v1/files", params={"limit": 2, "offset": 1}).json()
        assert page["data"] == listing["data"][1:3] and page["total"] == len(expected)
        assert client.get("/v1/files", params={"offset": 5}).json()["data"] == []
        for params in ({"limit": 0}, {"limit": 1001}, {"offset": -1}):
            is_problem(client.get("/v1/files", params=params), 422, "validation_error")

        # summaries are cached by file identity: a rewritten file is read again
        write_fixture(models_dir / "a.gguf", kv=[("general.file_type", 1, V.UINT32, None)], tensors={})
        again = {f["path"]: f for f in client.get("/v1/files").json()["data"]}
        assert again["a.gguf"]["n_tensors"] == 0 and again["a.gguf"]["file_type"] == 1
        assert again["s-00001-of-00002.gguf"] == files["s-00001-of-00002.gguf"]


# -- names and shared loads ------------------------------------------------------------------

BODY = {"model": "m.gguf", "load_mode": "none", "n_gpu_layers": 99}


def test_a_shared_load_holds_one_copy_until_its_last_reference(hoist_serve: Any, models_dir: Path) -> None:
    _device_model(models_dir / "m.gguf", 8 * MiB)
    server: ServeProcess = hoist_serve(HOIST_EMULATED_DEVICES="EMU0=64MiB")
    with httpx.Client(base_url=server.url, timeout=30) as client:
        total = _emu(client)["total_bytes"]
        first = wait_for(client, client.post("/v1/loads", json={**BODY, "name": "m"}).headers["location"], ENDED)
        assert first["state"] == "succeeded" and first["shared"] is False and first["name"] == "m", first
        one_copy = first["memory_summary"]["by_device"]["EMU0"]["EMU0"]
        assert one_copy >= 8 * MiB
        model = client.get("/v1/models/m").json()
        assert model["id"] == first["model_id"] == first["id"] and model["references"] == 1

        # the same placement spelled otherwise (every layer, -lm none), without a name:
        # shared at once, nothing moved, no second reservation
        resp = client.post("/v1/loads", json={"model": "m.gguf", "load_mode": "none", "n_gpu_layers": "all"})
        assert resp.status_code == 202, resp.text
        second = resp.json()
        assert second["state"] == "succeeded" and second["shared"] is True, second
        assert second["model_id"] == first["id"] and second["name"] == "m" and second["bytes_total"] == 0
        emu = _emu(client)
        assert [u["name"] for u in emu["models"]] == ["m"]
        assert emu["used_by_models_bytes"] == one_copy and emu["free_bytes"] == total - one_copy
        assert emu["reserved_bytes"] == one_copy
        listed = client.get("/v1/models").json()
        assert listed["total"] == 1 and listed["data"][0]["references"] == 2
        # the model answers by the id of either load too
        assert client.get(f"/v1/models/{second['id']}").json()["id"] == first["id"]

        # another placement under the same name is refused; under another name it loads apart
        conflict = is_problem(client.post("/v1/loads", json={**BODY, "n_gpu_layers": 0, "name": "m"}), 409)
        assert conflict["code"] == "name_taken" and "another 'name'" in conflict["hint"]
        cpu = wait_for(
            client,
            client.post("/v1/loads", json={**BODY, "n_gpu_layers": 0, "name": "m-cpu"}).headers["location"],
            ENDED,
        )
        assert (
            cpu["state"] == "succeeded" and cpu["shared"] is False and "EMU0" not in cpu["memory_summary"]["by_device"]
        )

        # each DELETE drops one reference; the last frees the memory
        dropped = client.delete("/v1/models/m").json()
        assert dropped["state"] == "resident" and dropped["references"] == 1
        assert _emu(client)["free_bytes"] == total - one_copy
        freed = client.delete("/v1/models/m").json()
        assert freed["state"] == "unloaded" and freed["references"] == 0
        is_problem(client.get("/v1/models/m"), 404, "not_found")
        emu = _emu(client)
        assert emu["free_bytes"] == total and emu["reserved_bytes"] == 0 and emu["models"] == []
        assert client.get(first["links"]["self"]).json()["memory"] is None
        assert client.delete("/v1/models/m-cpu").json()["state"] == "unloaded"


def test_names_are_checked(hoist_serve: Any, models_dir: Path) -> None:
    block_model(models_dir / "m.gguf", 1)
    block_model(models_dir / "odd name.gguf", 1)
    server: ServeProcess = hoist_serve()
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for name in ("", "../x", "a//b", "-x", "x/ready", "a b", "é", "x" * 257):
            is_problem(client.post("/v1/loads", json={"model": "m.gguf", "name": name}), 422, "validation_error")
        # a path that cannot be a name needs one
        body = is_problem(client.post("/v1/loads", json={"model": "odd name.gguf"}), 400, "invalid_request")
        assert "name" in body["hint"]
        job = wait_for(
            client,
            client.post("/v1/loads", json={"model": "odd name.gguf", "name": "org/odd:1"}).headers["location"],
            ENDED,
        )
        assert job["state"] == "succeeded"
        assert client.get("/v1/models/org/odd:1").json()["model"] == "odd name.gguf"
        assert client.get("/v1/models/org/odd:1/ready").json() == {"name": "org/odd:1", "id": job["id"], "ready": True}
        is_problem(client.get("/v1/models/nothing/ready"), 404, "not_found")


# -- keep_alive ------------------------------------------------------------------------------


def test_keep_alive_zero_unloads_once_loaded(hoist_serve: Any, models_dir: Path) -> None:
    _device_model(models_dir / "m.gguf", 4 * MiB)
    server: ServeProcess = hoist_serve(HOIST_EMULATED_DEVICES="EMU0=64MiB")
    with httpx.Client(base_url=server.url, timeout=30) as client:
        location = client.post("/v1/loads", json={**BODY, "keep_alive": 0}).headers["location"]
        job = wait_for(client, location, ENDED)
        assert job["state"] == "succeeded" and job["keep_alive"] == 0
        _wait_gone(client, "m.gguf", timeout=10)
        after = client.get(location).json()
        assert any("keep_alive ran out" in w for w in after["warnings"]), after
        emu = _emu(client)
        assert emu["free_bytes"] == emu["total_bytes"] and emu["reserved_bytes"] == 0


def test_keep_alive_expires_and_a_newer_load_resets_it(hoist_serve: Any, models_dir: Path) -> None:
    _device_model(models_dir / "m.gguf", 4 * MiB)
    server: ServeProcess = hoist_serve(HOIST_EMULATED_DEVICES="EMU0=64MiB")
    with httpx.Client(base_url=server.url, timeout=30) as client:
        job = wait_for(client, client.post("/v1/loads", json={**BODY, "keep_alive": "1s"}).headers["location"], ENDED)
        assert job["state"] == "succeeded"
        model = client.get("/v1/models/m.gguf").json()
        assert model["keep_alive"] == 1.0 and model["expires_at"] is not None
        elapsed = _wait_gone(client, "m.gguf")
        assert elapsed < 5

        # a shared load restarts the timer with its own keep_alive (here: forever) ...
        job = wait_for(client, client.post("/v1/loads", json={**BODY, "keep_alive": "1s"}).headers["location"], ENDED)
        shared = client.post("/v1/loads", json={**BODY, "keep_alive": -1}).json()
        assert shared["shared"] is True
        model = client.get("/v1/models/m.gguf").json()
        assert model["expires_at"] is None and model["keep_alive"] == FOREVER
        time.sleep(1.5)
        assert client.get("/v1/models/m.gguf").status_code == 200
        # ... and a later one with a short keep_alive unloads it, references and all
        assert client.post("/v1/loads", json={**BODY, "keep_alive": "300ms"}).json()["shared"] is True
        _wait_gone(client, "m.gguf")
        emu = _emu(client)
        assert emu["free_bytes"] == emu["total_bytes"] and emu["reserved_bytes"] == 0


def test_the_default_keep_alive_is_a_setting(hoist_serve: Any, models_dir: Path) -> None:
    block_model(models_dir / "m.gguf", 1)
    server: ServeProcess = hoist_serve(HOIST_KEEP_ALIVE="500ms")
    with httpx.Client(base_url=server.url, timeout=30) as client:
        job = wait_for(client, client.post("/v1/loads", json={"model": "m.gguf"}).headers["location"], ENDED)
        assert job["keep_alive"] == 0.5
        _wait_gone(client, "m.gguf")


# -- eviction --------------------------------------------------------------------------------


@pytest.mark.parametrize("evict", [False, True])
def test_idle_models_are_evicted_least_recently_used_first(hoist_serve: Any, models_dir: Path, evict: bool) -> None:
    _device_model(models_dir / "m.gguf", 24 * MiB)
    server: ServeProcess = hoist_serve(HOIST_EMULATED_DEVICES="EMU0=64MiB", HOIST_EVICT_IDLE="1" if evict else "0")
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for name in ("a", "b"):
            done = wait_for(client, client.post("/v1/loads", json={**BODY, "name": name}).headers["location"], ENDED)
            assert done["state"] == "succeeded", done
        # a shared load makes 'a' the more recently used
        assert client.post("/v1/loads", json={**BODY, "name": "a"}).json()["shared"] is True
        resp = client.post("/v1/loads", json={**BODY, "name": "c"})
        if not evict:
            is_problem(resp, 409, "insufficient_device_memory")
            assert {m["name"] for m in client.get("/v1/models").json()["data"]} == {"a", "b"}
            return
        assert resp.status_code == 202, resp.text
        job = wait_for(client, resp.headers["location"], ENDED)
        assert job["state"] == "succeeded", job
        evicted = [w for w in job["warnings"] if w.startswith("evicted")]
        assert len(evicted) == 1 and "'b'" in evicted[0], job["warnings"]
        assert {m["name"] for m in client.get("/v1/models").json()["data"]} == {"a", "c"}
        emu = _emu(client)
        assert emu["used_by_models_bytes"] == 2 * done["memory_summary"]["by_device"]["EMU0"]["EMU0"]
        # a model larger than the device is refused without evicting anything
        _device_model(models_dir / "huge.gguf", 80 * MiB)
        is_problem(client.post("/v1/loads", json={**BODY, "model": "huge.gguf"}), 409, "insufficient_device_memory")
        assert {m["name"] for m in client.get("/v1/models").json()["data"]} == {"a", "c"}


# -- preloading and readiness ----------------------------------------------------------------


def test_readiness_waits_for_the_preloaded_models(hoist_serve: Any, models_dir: Path) -> None:
    _device_model(models_dir / "m.gguf", 8 * MiB)
    preload = [{"model": "m.gguf", "name": "slow", "n_gpu_layers": 99, "load_mode": "none"}]
    server: ServeProcess = hoist_serve(
        HOIST_EMULATED_DEVICES="EMU0=64MiB:bandwidth=4MiB", HOIST_PRELOAD=json.dumps(preload), HOIST_API_TOKEN="s3cret"
    )
    auth = {"Authorization": "Bearer s3cret"}
    with httpx.Client(base_url=server.url, timeout=30) as client:
        # the probe needs no token; the API does
        is_problem(client.get("/v1/models"), 401)
        body = is_problem(client.get("/readyz"), 503, "not_ready")
        assert [p["name"] for p in body["pending"]] == ["slow"] and body["failed"] == []
        is_problem(client.get("/v1/models/slow/ready", headers=auth), 503, "not_ready")
        deadline = time.monotonic() + 30
        while (resp := client.get("/readyz")).status_code != 200:
            assert time.monotonic() < deadline, resp.text
            time.sleep(0.1)
        assert resp.json() == {"status": "ready", "models": ["slow"]}
        assert client.get("/v1/models/slow/ready", headers=auth).json()["ready"] is True
        job = client.get("/v1/loads", headers=auth).json()["data"][0]
        assert job["name"] == "slow" and job["plan"]["n_gpu_layers"] == 99 and job["load_mode"] == "none"
        # an unloaded preloaded model is not ready any more
        assert client.delete("/v1/models/slow", headers=auth).json()["state"] == "unloaded"
        body = is_problem(client.get("/readyz"), 503, "not_ready")
        assert [p["name"] for p in body["pending"]] == ["slow"]
        is_problem(client.get("/v1/models/slow/ready", headers=auth), 503, "not_ready")


def test_preload_as_a_list_of_paths_reports_failures(hoist_serve: Any, models_dir: Path) -> None:
    block_model(models_dir / "a.gguf", 1)
    server: ServeProcess = hoist_serve(HOIST_PRELOAD="a.gguf, missing.gguf")
    with httpx.Client(base_url=server.url, timeout=30) as client:
        deadline = time.monotonic() + 20
        while True:
            body = is_problem(client.get("/readyz"), 503, "not_ready")
            if not body["pending"]:
                break
            assert time.monotonic() < deadline, body
            time.sleep(0.05)
        assert [(f["name"], f["error"]["code"]) for f in body["failed"]] == [("missing.gguf", "model_not_found")]
        assert client.get("/v1/models/a.gguf/ready").status_code == 200


def test_hostile_listing_and_names_are_bounded(tmp_path: Path) -> None:
    import os

    from gguf import GGUFValueType

    from service.api.catalog import MAX_ARCHITECTURE, Summaries, walk
    from service.api.keepalive import FOREVER, parse_keep_alive
    from service.api.spec import check_name
    from service.errors import RequestError
    from service.loader.gguf import HeaderLimits
    from tests.helpers import gguf_kv, gguf_string, raw_gguf

    models = tmp_path / "models"
    models.mkdir()
    # an architecture of 4 MiB is listed clipped
    kv = [gguf_kv("general.architecture", GGUFValueType.STRING, gguf_string("A" * (4 << 20)))]
    (models / "big.gguf").write_bytes(raw_gguf(kv, [], b""))
    summary = Summaries(str(models), HeaderLimits(max_bytes=64 << 20)).summary("big.gguf")
    assert summary["architecture"].startswith("AAAA") and len(summary["architecture"]) < MAX_ARCHITECTURE + 64
    # a tree deeper than the walk goes leaves its depths out, not its siblings
    deep = models / "deep"
    for i in range(12):
        deep = deep / f"d{i}"
    deep.mkdir(parents=True)
    (deep / "x.gguf").write_bytes(b"GGUF")
    for i in range(5):
        (models / "zz" / str(i)).mkdir(parents=True)
        (models / "zz" / str(i) / "m.gguf").write_bytes(b"GGUF")
    found = walk(str(models))
    assert found.truncated and sum(p.startswith("zz" + os.sep) for p in found.paths) == 5
    # numbers far past a float, and digits other than ASCII's
    with pytest.raises(RequestError):
        parse_keep_alive(10**400)
    assert parse_keep_alive(-(10**400)) == FOREVER
    with pytest.raises(RequestError):
        parse_keep_alive("\u0663")
    # a name shaped like a job id would be found as that job's model
    with pytest.raises(RequestError, match="load job's id"):
        check_name("lj_00019060aadc")
    assert check_name("lj_model") == "lj_model"
