"""What an attacker on a shared host could try against a running ``hoist serve``: files
that change under a load, numbers that size structures, costly patterns, floods of
loads, missing tokens. Each is answered with a typed problem quickly, and the server
stays up with its memory back near where it was."""

from __future__ import annotations

import os
import random
import struct
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from gguf import GGUFValueType as V

from tests.api.test_loads import put, wait_for
from tests.conftest import ServeProcess
from tests.helpers import block_model, gguf_kv, gguf_string, gguf_tensor_info, raw_gguf, write_fixture

MiB = 1 << 20
ENDED = {"succeeded", "failed", "cancelled"}


def is_problem(resp: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/problem+json"), resp.headers
    body: dict[str, Any] = resp.json()
    assert body["status"] == status and body["detail"]
    if code is not None:
        assert body["code"] == code, body
    return body


# -- a file that shrinks during a load --------------------------------------------------------


def test_truncating_the_file_during_an_emulated_gpu_mmap_load(
    hoist_serve: Any, models_dir: Path, tmp_path: Path
) -> None:
    path = block_model(models_dir / "big.gguf", 8, elements=3 << 20)  # 8 x 2 x 12 MiB of F32
    size = path.stat().st_size
    server: ServeProcess = hoist_serve(HOIST_EMULATED_DEVICES="EMU0=2000MiB")
    rng = random.Random(7)
    outcomes: list[str] = []
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for _ in range(12):
            resp = client.post("/v1/loads", json={"model": path.name, "load_mode": "mmap", "n_gpu_layers": 99})
            assert resp.status_code == 202, resp.text
            time.sleep(rng.uniform(0, 0.12))
            os.truncate(path, size // 2)
            job = wait_for(client, resp.headers["location"], ENDED)
            assert server.alive, server.output()
            if job["state"] == "failed":
                # the copy to the device read through the file: a short read, named
                assert job["error"]["code"] == "storage_error", job["error"]
                assert "big.gguf" in job["error"]["message"]
            else:
                assert job["state"] == "succeeded", job
                assert client.delete(f"/v1/models/{job['model_id']}").status_code == 200
            outcomes.append(job["state"])
            os.truncate(path, size)  # the same size again (zeros), for the next try
        assert client.get("/healthz").status_code == 200
    assert "failed" in outcomes  # some truncations landed during a load
    assert server.alive


_SHRINK_AFTER_POPULATE = """
import asyncio, os, sys
from service.errors import HoistError
from service.io import direct
from service.io.mapping import Mapping
from service.loader.devices import CPUDevice, parse_emulated_devices
from service.loader.pipeline import LoadOptions, load_model
from service.loader.placement import make_params
from service.loader.weights import open_model

path, devices, check = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
real_populate, real_pread = Mapping.populate, direct.pread_into

# the worst moment: the bytes of a large tensor were just brought in (faulted into the
# mapping, or read), then the file shrinks to end where they begin
def populate_then_shrink(self, offset, nbytes):
    real_populate(self, offset, nbytes)
    if nbytes >= 1 << 20:
        os.truncate(self.path, offset)

def read_then_shrink(fd, dest, offset, *, path, tensor=None):
    real_pread(fd, dest, offset, path=path, tensor=tensor)
    if len(dest) >= 1 << 20:
        os.truncate(path, offset)

Mapping.populate = populate_then_shrink
direct.pread_into = read_then_shrink
devs = [CPUDevice(), *parse_emulated_devices(devices or None)]
params = make_params([d.default_buffer_type.name for d in devs], load_mode="mmap", n_gpu_layers=99)
try:
    asyncio.run(load_model(open_model(path), devices=devs, params=params, options=LoadOptions(check_tensors=check)))
except HoistError as exc:
    print("ERROR", exc.code, exc.describe())
    sys.exit(0)
print("LOADED")
"""


@pytest.mark.parametrize("devices", ["", "EMU0=1GiB"])
@pytest.mark.parametrize("check", [False, True])
def test_a_file_that_shrinks_right_after_its_pages_were_read(tmp_path: Path, devices: str, check: bool) -> None:
    import subprocess
    import sys

    path = _device_model(tmp_path / "m.gguf", 8 * MiB)
    script = tmp_path / "shrink.py"
    script.write_text(_SHRINK_AFTER_POPULATE)
    root = Path(__file__).resolve().parent.parent.parent
    run = subprocess.run(
        [sys.executable, str(script), str(path), devices, "1" if check else "0"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    # a signal would end the process with a negative status (SIGBUS: -7)
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    assert run.stdout.startswith("ERROR storage_error"), run.stdout + run.stderr[-2000:]
    assert "m.gguf" in run.stdout


# -- numbers from a file that size structures -----------------------------------------------


def _arch_kv(arch: str = "llama") -> bytes:
    return gguf_kv("general.architecture", V.STRING, gguf_string(arch))


def _f32_tensor(name: str) -> tuple[bytes, bytes]:
    return gguf_tensor_info(name, [8], 0, 0), np.ones(8, dtype=np.float32).tobytes()


HUGE_LAYER_FILES: dict[str, tuple[list[bytes], list[bytes], bytes, str]] = {
    "block_count_u32_max.gguf": (
        [_arch_kv(), gguf_kv("llama.block_count", V.UINT32, struct.pack("<I", 0xFFFFFFFF))],
        [_f32_tensor("token_embd.weight")[0]],
        _f32_tensor("token_embd.weight")[1],
        "llama.block_count",
    ),
    "block_count_1e7.gguf": (
        [_arch_kv(), gguf_kv("llama.block_count", V.UINT32, struct.pack("<I", 10**7))],
        [_f32_tensor("token_embd.weight")[0]],
        _f32_tensor("token_embd.weight")[1],
        "llama.block_count",
    ),
    "block_count_u64.gguf": (
        [_arch_kv(), gguf_kv("llama.block_count", V.UINT64, struct.pack("<Q", 2**64 - 1))],
        [_f32_tensor("token_embd.weight")[0]],
        _f32_tensor("token_embd.weight")[1],
        "llama.block_count",
    ),
    "layer_in_name.gguf": (
        [_arch_kv()],
        [_f32_tensor("blk.99999999999999999999.a")[0]],
        _f32_tensor("blk.99999999999999999999.a")[1],
        "blk.99999999999999999999.a",
    ),
    "layer_512_in_name.gguf": (
        [_arch_kv()],
        [_f32_tensor("blk.512.attn_q.weight")[0]],
        _f32_tensor("blk.512.attn_q.weight")[1],
        "blk.512.attn_q.weight",
    ),
}


def test_huge_layer_counts_are_refused_quickly(hoist_serve: Any, models_dir: Path) -> None:
    for name, (kvs, infos, data, _) in HUGE_LAYER_FILES.items():
        (models_dir / name).write_bytes(raw_gguf(kvs, infos, data))
    server: ServeProcess = hoist_serve(HOIST_EMULATED_DEVICES="EMU0=1GiB")
    with httpx.Client(base_url=server.url, timeout=60) as client:
        client.post("/v1/plans", json={"model": "layer_in_name.gguf"})  # warm up
        baseline = server.rss()
        for name, (*_, named) in HUGE_LAYER_FILES.items():
            for route in ("/v1/plans", "/v1/loads"):
                started = time.perf_counter()
                body = is_problem(client.post(route, json={"model": name, "n_gpu_layers": 99}), 422)
                assert time.perf_counter() - started < 5
                assert "at most 512 layers" in body["detail"] and named in body["detail"], body
                assert body["path"] == name
        assert server.rss() < baseline + 32 * MiB
        assert client.get("/v1/loads").json()["data"] == []


def test_the_largest_model_llama_cpp_allows_plans_in_bounded_size(live_server: str, models_dir: Path) -> None:
    block_model(models_dir / "m512.gguf", 512, per_block=("attn_q.weight",), elements=32)
    with httpx.Client(base_url=live_server, timeout=60) as client:
        resp = client.post("/v1/plans", json={"model": "m512.gguf"})
        assert resp.status_code == 200, resp.text
        assert resp.json()["n_layer"] == 512 and len(resp.json()["layers"]) == 514
        assert len(resp.content) < 1 * MiB  # grows with the 515 tensors, not a declared number


# -- costly override patterns -------------------------------------------------------------------


BOMBS: dict[str, list[str]] = {
    "nested repetition": ["(?:a{30000}){100}=CPU"],
    "nested repetition, 20 GB": ["(?:a{10000}){10000}=CPU"],
    "repetition count": ["a{100000}=CPU"],
    "many nested small": ["(?:(?:(?:a{100}){100}){100})=CPU"],
    "six bombs": ["(?:a{30000}){100}=CPU"] * 6,
    "backtracking x 40": [r"^(?:.*(.|.)){9}\d$=CPU"] * 40,
    "10,000 overrides": ["blk=CPU"] * 10_000,
    "long pattern": ["a" * 100_000 + "=CPU"],
}


def _long_names_model(path: Path) -> Path:
    rng = np.random.default_rng(0)
    f32 = np.float32
    tensors = {
        f"blk.{i}.{'x' * 40}_{j}.weight": (rng.standard_normal(8).astype(f32), _f32())
        for i in range(4)
        for j in range(8)
    }
    write_fixture(path, tensors=tensors)
    return path


def _f32():  # type: ignore[no-untyped-def]
    import gguf

    return gguf.GGMLQuantizationType.F32


def test_override_bombs_are_refused_quickly(hoist_serve: Any, models_dir: Path) -> None:
    _long_names_model(models_dir / "names.gguf")
    server: ServeProcess = hoist_serve()
    with httpx.Client(base_url=server.url, timeout=120) as client:
        assert client.post("/v1/plans", json={"model": "names.gguf", "override_tensor": ["x=CPU"]}).status_code == 200
        baseline = server.rss()
        for what, overrides in BOMBS.items():
            cpu = server.cpu_seconds()
            started = time.perf_counter()
            resp = client.post("/v1/plans", json={"model": "names.gguf", "override_tensor": overrides})
            elapsed = time.perf_counter() - started
            assert resp.status_code in (400, 422), (what, resp.text[:500])
            is_problem(resp, resp.status_code)
            # answered or refused within about a second of the server's CPU, not minutes
            assert server.cpu_seconds() - cpu < 3, what
            assert elapsed < 10, what
            assert server.rss() < baseline + 48 * MiB, (what, server.rss() - baseline)
            assert client.get("/healthz").status_code == 200


def test_a_pattern_that_backtracks_meets_the_plan_budget(live_server: str, models_dir: Path) -> None:
    _long_names_model(models_dir / "names.gguf")
    with httpx.Client(base_url=live_server, timeout=60) as client:
        resp = client.post(
            "/v1/plans", json={"model": "names.gguf", "override_tensor": [r"^(?:.*(.|.)){9}\d$=CPU"] * 40}
        )
        body = is_problem(resp, resp.status_code)
        assert body["code"] in ("work_limit_exceeded", "invalid_placement"), body
        ok = client.post("/v1/plans", json={"model": "names.gguf", "override_tensor": [r"blk\.[0-1]\.=CPU"] * 40})
        assert ok.status_code == 200
        assert [o["matched"] for o in ok.json()["overrides"]] == [16] + [0] * 39


# -- slow headers, abandoned requests -------------------------------------------------------


def _many_kv_model(path: Path, n: int) -> Path:
    kvs = [gguf_kv(f"k.{i}", V.UINT32, struct.pack("<I", i)) for i in range(n)]
    name, data = _f32_tensor("w")
    path.write_bytes(raw_gguf(kvs, [name], data))
    return path


def _slow_header_model(path: Path, n_strings: int = 3_000_000) -> Path:
    """A valid header within every limit that still takes a while to read: one array of
    many empty strings (each walked to find the next)."""
    payload = struct.pack("<IQ", V.STRING, n_strings) + struct.pack("<Q", 0) * n_strings
    kvs = [_arch_kv(), gguf_kv("tokenizer.ggml.tokens", V.ARRAY, payload)]
    name, data = _f32_tensor("w")
    path.write_bytes(raw_gguf(kvs, [name], data))
    return path


def test_a_slow_header_does_not_hold_up_other_plans(live_server: str, models_dir: Path) -> None:
    import threading

    _slow_header_model(models_dir / "slow.gguf")
    _many_kv_model(models_dir / "fast.gguf", 1)
    finished: list[str] = []

    def slow() -> None:
        with httpx.Client(base_url=live_server, timeout=120) as c:
            assert c.post("/v1/plans", json={"model": "slow.gguf"}).status_code == 200
        finished.append("slow")

    thread = threading.Thread(target=slow)
    thread.start()
    time.sleep(0.2)
    with httpx.Client(base_url=live_server, timeout=60) as client:
        for _ in range(3):
            assert client.post("/v1/plans", json={"model": "fast.gguf"}).status_code == 200
    finished.append("fast")
    thread.join()
    assert finished == ["fast", "slow"]


def test_an_abandoned_request_stops_its_work(
    live_server: str, models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from service.cancel import CancelToken
    from service.errors import RequestAbandonedError

    _many_kv_model(models_dir / "m.gguf", 1)
    from service.loader import weights  # the job manager imports open_model from it when it plans

    real_open = weights.open_model
    seen: dict[str, Any] = {}
    stopped = threading.Event()

    def endless(path: str, *, cancel: CancelToken | None = None, **kwargs: Any) -> Any:
        assert cancel is not None
        try:
            while True:  # a header that takes forever, checking its token as the reader does
                cancel.check()
                time.sleep(0.01)
        except RequestAbandonedError as exc:
            seen["error"] = exc
            stopped.set()
            raise
        return real_open(path, cancel=cancel, **kwargs)

    monkeypatch.setattr(weights, "open_model", endless)
    with httpx.Client(base_url=live_server) as client, pytest.raises(httpx.ReadTimeout):
        client.post("/v1/plans", json={"model": "m.gguf"}, timeout=0.5)
    assert stopped.wait(5), "the work went on after its client left"
    assert "client went away" in str(seen["error"])


def test_the_request_time_limit(hoist_serve: Any, models_dir: Path) -> None:
    _slow_header_model(models_dir / "slow.gguf")
    server: ServeProcess = hoist_serve(HOIST_REQUEST_TIMEOUT_S="0.2")
    with httpx.Client(base_url=server.url, timeout=60) as client:
        body = is_problem(client.post("/v1/plans", json={"model": "slow.gguf"}), 422, "work_limit_exceeded")
        assert "0.2 s" in body["detail"]


# -- admission ------------------------------------------------------------------------------------


def _device_model(path: Path, nbytes: int) -> Path:
    """A model of two layers whose ``nbytes`` of F32 weights all go to a GPU with -ngl 99
    (and a small token embedding on the CPU)."""
    f32 = _f32()
    tensors = {
        "token_embd.weight": (np.ones(64, dtype=np.float32), f32),
        "blk.0.attn_q.weight": (np.ones(nbytes // 8, dtype=np.float32), f32),
        "blk.1.attn_q.weight": (np.ones(nbytes // 8, dtype=np.float32), f32),
    }
    write_fixture(path, kv=[("llama.block_count", 2, V.UINT32, None)], tensors=tensors)
    return path


def test_queued_loads_are_bounded(hoist_serve: Any, models_dir: Path) -> None:
    _device_model(models_dir / "m.gguf", 4 * MiB)
    server: ServeProcess = hoist_serve(HOIST_EMULATED_DEVICES="EMU0=1GiB:bandwidth=1MiB", HOIST_MAX_QUEUED_LOADS="2")
    body = {"model": "m.gguf", "load_mode": "none", "n_gpu_layers": 99}
    with httpx.Client(base_url=server.url, timeout=30) as client:
        # each under its own name: a load of a model being loaded under the same name is refused
        accepted = [client.post("/v1/loads", json={**body, "name": f"q{i}"}) for i in range(3)]  # one runs, two wait
        assert [r.status_code for r in accepted] == [202, 202, 202]
        refused = client.post("/v1/loads", json={**body, "name": "q3"})
        is_problem(refused, 429, "busy")
        assert int(refused.headers["retry-after"]) > 0
        states = [client.get(r.headers["location"]).json()["state"] for r in accepted]
        assert states.count("queued") == 2
        for r in accepted:
            client.post(f"{r.headers['location']}/cancel")
        for r in accepted:
            assert wait_for(client, r.headers["location"], ENDED)["state"] == "cancelled"
        # the queue is free again
        again = client.post("/v1/loads", json={**body, "name": "q4"})
        assert again.status_code == 202
        client.post(f"{again.headers['location']}/cancel")


def test_memory_is_reserved_at_submit(hoist_serve: Any, models_dir: Path) -> None:
    _device_model(models_dir / "m.gguf", 24 * MiB)
    server: ServeProcess = hoist_serve(HOIST_EMULATED_DEVICES="EMU0=64MiB:bandwidth=8MiB")
    body = {"model": "m.gguf", "load_mode": "none", "n_gpu_layers": 99}
    with httpx.Client(base_url=server.url, timeout=30) as client:
        first = client.post("/v1/loads", json={**body, "name": "first"})
        second = client.post("/v1/loads", json={**body, "name": "second"})
        assert first.status_code == second.status_code == 202
        # the first is running and the second queued: neither holds EMU0 memory yet or
        # in full, but both are counted
        third = is_problem(client.post("/v1/loads", json={**body, "name": "third"}), 409, "insufficient_device_memory")
        assert "EMU0 needs" in third["detail"] and "reserved by 2 loads" in third["detail"], third
        emu = next(d for d in client.get("/v1/devices").json()["data"] if d["name"] == "EMU0")
        assert emu["reserved_bytes"] >= 48 * MiB
        client.post(f"{second.headers['location']}/cancel")
        assert wait_for(client, second.headers["location"], ENDED)["state"] == "cancelled"
        # the cancelled load's reservation is released: a new one fits again
        fourth = client.post("/v1/loads", json={**body, "name": "fourth"})
        assert fourth.status_code == 202, fourth.text
        for r in (first, fourth):
            client.post(f"{r.headers['location']}/cancel")
            wait_for(client, r.headers["location"], ENDED)


def test_the_load_time_limit(hoist_serve: Any, models_dir: Path) -> None:
    _device_model(models_dir / "m.gguf", 8 * MiB)
    server: ServeProcess = hoist_serve(HOIST_EMULATED_DEVICES="EMU0=64MiB:bandwidth=1MiB", HOIST_LOAD_TIMEOUT_S="0.5")
    body = {"model": "m.gguf", "load_mode": "none", "n_gpu_layers": 99}
    with httpx.Client(base_url=server.url, timeout=30) as client:
        job = wait_for(client, client.post("/v1/loads", json=body).headers["location"], ENDED)
        assert job["state"] == "failed" and job["error"]["code"] == "work_limit_exceeded", job
        emu = next(d for d in client.get("/v1/devices").json()["data"] if d["name"] == "EMU0")
        assert emu["free_bytes"] == emu["total_bytes"] and emu["reserved_bytes"] == 0


def test_resident_models_count_against_new_loads(hoist_serve: Any, models_dir: Path) -> None:
    _device_model(models_dir / "m.gguf", 24 * MiB)
    server: ServeProcess = hoist_serve(HOIST_EMULATED_DEVICES="EMU0=64MiB")
    body = {"model": "m.gguf", "load_mode": "mmap", "n_gpu_layers": 99}
    with httpx.Client(base_url=server.url, timeout=30) as client:
        # two copies, by two names (one name would share one copy)
        done = [
            wait_for(client, client.post("/v1/loads", json={**body, "name": n}).headers["location"], ENDED)
            for n in ("a", "b")
        ]
        assert [d["state"] for d in done] == ["succeeded", "succeeded"]
        is_problem(client.post("/v1/loads", json={**body, "name": "c"}), 409, "insufficient_device_memory")
        assert client.delete(f"/v1/models/{done[0]['model_id']}").status_code == 200
        third = wait_for(client, client.post("/v1/loads", json={**body, "name": "c"}).headers["location"], ENDED)
        assert third["state"] == "succeeded"


def test_a_big_endian_file_is_refused_at_submit(live_server: str, models_dir: Path, tmp_path: Path) -> None:
    import gguf

    write_fixture(
        models_dir / "be.gguf",
        tensors={"w": (np.ones(8, dtype=np.float32), _f32())},
        endian=gguf.GGUFEndian.BIG,
    )
    with httpx.Client(base_url=live_server) as client:
        body = is_problem(client.post("/v1/loads", json={"model": "be.gguf"}), 422, "unsupported_byte_order")
        assert "gguf-convert-endian" in body["detail"]
        assert client.get("/v1/loads").json()["data"] == []
        # a dry run plans it, and says it cannot be loaded
        planned = client.post("/v1/plans", json={"model": "be.gguf"})
        assert planned.status_code == 200
        assert any("big-endian" in w and "not loaded" in w for w in planned.json()["warnings"])


# -- leaks and inconsistencies -------------------------------------------------------------------------


def test_no_response_reveals_a_server_path(
    hoist_serve: Any, models_dir: Path, all_types_fixture: Any, tmp_path: Path
) -> None:
    name = put(models_dir, all_types_fixture)
    server: ServeProcess = hoist_serve(HOIST_EMULATED_DEVICES="EMU0=64MiB")
    secrets = {str(models_dir), str(models_dir.resolve()), str(tmp_path), str(tmp_path.resolve())}
    bodies: list[str] = []
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for mode in ("mmap", "none", "direct-io", "mlock", "mmap+mlock"):
            resp = client.post("/v1/loads", json={"model": name, "load_mode": mode, "n_gpu_layers": 1, "name": mode})
            bodies.append(resp.text)
            job = wait_for(client, resp.headers["location"], ENDED)
            bodies += [client.get(resp.headers["location"]).text, client.get(f"{resp.headers['location']}/plan").text]
            assert job["state"] == "succeeded", job
        bodies += [client.get(p).text for p in ("/v1/loads", "/v1/models", "/v1/devices", "/openapi.json")]
        bodies.append(client.post("/v1/plans", json={"model": name}).text)
        for bad in ("missing.gguf", "../x.gguf", "/etc/passwd", name + "/x"):
            bodies.append(client.post("/v1/plans", json={"model": bad}).text)
        (models_dir / "bad.gguf").write_bytes(b"GGUF" + b"\0" * 100)
        bodies.append(client.post("/v1/loads", json={"model": "bad.gguf"}).text)
    for body in bodies:
        for secret in secrets:
            assert secret not in body, (secret, body[:2000])
    assert any(name in b for b in bodies)


def test_unhandled_errors_are_problems(live_server: str, models_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from service.api.jobs import JobManager

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("/secret/internal/path exploded")

    def exhausted(*args: Any, **kwargs: Any) -> Any:
        raise MemoryError()

    with httpx.Client(base_url=live_server) as client:
        monkeypatch.setattr(JobManager, "get", broken)
        body = is_problem(client.get("/v1/loads/lj_x"), 500, "internal_error")
        assert "secret" not in body["detail"]
        monkeypatch.setattr(JobManager, "get", exhausted)
        body = is_problem(client.get("/v1/loads/lj_x"), 507, "out_of_memory")
        assert body["detail"]
        monkeypatch.undo()
        is_problem(client.get("/v1/loads/lj_x"), 404, "not_found")
        is_problem(client.get("/no/such/route"), 404)
        refused = client.delete("/healthz")
        is_problem(refused, 405)
        assert refused.headers["allow"] == "GET, HEAD"
        assert client.head("/healthz").status_code == 200
        assert client.put("/v1/loads").headers["allow"] == "GET, HEAD, POST"
        assert client.post("/v1/models/x").headers["allow"] == "GET, HEAD, DELETE"
        assert client.get("/healthz").status_code == 200


def test_a_large_body_is_refused_before_it_is_read(live_server: str) -> None:
    with httpx.Client(base_url=live_server) as client:
        is_problem(client.post("/v1/plans", content=b"x" * (2 * MiB)), 413, "content_too_large")

        def chunks():  # type: ignore[no-untyped-def]
            for _ in range(64):
                yield b" " * 65536

        is_problem(client.post("/v1/plans", content=chunks()), 413, "content_too_large")


# -- authentication --------------------------------------------------------------------------------------


TOKEN = "s3cret-token-for-tests"


def test_the_token_is_required(hoist_serve: Any, models_dir: Path, all_types_fixture: Any) -> None:
    name = put(models_dir, all_types_fixture)
    server: ServeProcess = hoist_serve(HOIST_API_TOKEN=TOKEN)
    with httpx.Client(base_url=server.url, timeout=30) as client:
        assert client.get("/healthz").status_code == 200
        for method, path in [
            ("GET", "/v1/loads"),
            ("POST", "/v1/loads"),
            ("POST", "/v1/plans"),
            ("GET", "/v1/models"),
            ("DELETE", "/v1/models/x"),
            ("GET", "/v1/devices"),
            ("GET", "/openapi.json"),
            ("GET", "/docs"),
            ("GET", "/nothing/here"),
        ]:
            resp = client.request(method, path, json={"model": name})
            is_problem(resp, 401, "unauthorized")
            assert resp.headers["www-authenticate"].startswith("Bearer")
            wrong = client.request(method, path, json={"model": name}, headers={"Authorization": "Bearer nope"})
            is_problem(wrong, 401)
            assert 'error="invalid_token"' in wrong.headers["www-authenticate"]
            basic = client.request(method, path, headers={"Authorization": f"Basic {TOKEN}"})
            is_problem(basic, 401)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=server.url, timeout=30, headers=auth) as client:
        resp = client.post("/v1/loads", json={"model": name})
        assert resp.status_code == 202
        assert wait_for(client, resp.headers["location"], ENDED)["state"] == "succeeded"
        assert client.get("/v1/models").json()["data"]


def test_the_token_from_a_file(hoist_serve: Any, tmp_path: Path) -> None:
    secret = tmp_path / "token"
    secret.write_text(TOKEN + "\n")
    server: ServeProcess = hoist_serve(HOIST_API_TOKEN_FILE=str(secret))
    with httpx.Client(base_url=server.url) as client:
        is_problem(client.get("/v1/devices"), 401)
        assert client.get("/v1/devices", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


def test_serve_refuses_an_open_address_without_a_token(hoist_serve: Any, models_dir: Path) -> None:
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("HOIST_")}
    run = subprocess.run(
        [sys.executable, "-c", "import sys; from service.cli import main; sys.exit(main())", "serve"]
        + ["--host", "0.0.0.0", "--port", "1", "--models-dir", str(models_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert run.returncode == 1
    assert "without an API token" in run.stderr and "--allow-unauthenticated" in run.stderr
    server: ServeProcess = hoist_serve(args=["--host", "0.0.0.0", "--allow-unauthenticated"])
    assert server.alive
    with_token: ServeProcess = hoist_serve(args=["--host", "0.0.0.0"], HOIST_API_TOKEN=TOKEN)
    assert httpx.get(f"{with_token.url}/v1/devices").status_code == 401
