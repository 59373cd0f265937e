"""What a file can make the service spend: header memory, tensors, splits, plan work and
the plans jobs keep; and files opened as they are, not as they were named."""

from __future__ import annotations

import asyncio
import os
import struct
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from gguf import GGUFValueType as V

from service.errors import HeaderTooLargeError, RequestError
from tests.api.test_hostile import ENDED, _f32_tensor, is_problem
from tests.api.test_loads import wait_for
from tests.conftest import ServeProcess
from tests.helpers import gguf_kv, gguf_string, gguf_tensor_info, raw_gguf
from tests.resources import fds_on

MiB = 1 << 20


def _sparse_header(path: Path, arrays: int, nbytes: int) -> Path:
    """A file whose header declares ``arrays`` u8 arrays of ``nbytes`` each, holes on disk."""
    with open(path, "wb") as f:
        f.write(b"GGUF" + struct.pack("<IQQ", 3, 1, arrays + 1))
        f.write(gguf_kv("general.architecture", V.STRING, gguf_string("llama")))
        for i in range(arrays):
            f.write(gguf_string(f"big.{i}") + struct.pack("<IIQ", V.ARRAY, V.UINT8, nbytes))
            f.seek(nbytes, os.SEEK_CUR)
        f.write(gguf_tensor_info("t", [8], 0, 0))
        f.write(b"\0" * ((-f.tell()) % 32 + 32))
    return path


def test_a_header_larger_than_the_limit_is_refused_before_it_is_read(hoist_serve: Any, models_dir: Path) -> None:
    _sparse_header(models_dir / "huge_header.gguf", 2, 1 << 30)  # 2 GiB of header, a few KiB on disk
    server: ServeProcess = hoist_serve(HOIST_MAX_GGUF_HEADER_BYTES=str(64 * MiB))
    rss = server.rss()
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for route in ("/v1/plans", "/v1/loads"):
            body = is_problem(client.post(route, json={"model": "huge_header.gguf"}), 422, "header_too_large")
            assert str(64 * MiB) in body["detail"] and body["path"] == "huge_header.gguf"
    assert server.rss() < rss + 200 * MiB


def _many_tensors(path: Path, n: int, *, interleave: bool = False) -> Path:
    infos = []
    for i in range(n):
        name = (f"blk.0.a{i}" if i % 2 == 0 else f"z{i}") if interleave else f"t{i}"
        infos.append(gguf_tensor_info(name, [8], 0, 32 * i))
    kvs = [gguf_kv("general.architecture", V.STRING, gguf_string("llama"))]
    path.write_bytes(raw_gguf(kvs, infos, b"\0" * (32 * n)))
    return path


def test_tensor_and_kv_counts_are_bounded(hoist_serve: Any, models_dir: Path) -> None:
    _many_tensors(models_dir / "many.gguf", 200)
    kvs = [gguf_kv(f"k.{i}", V.UINT32, struct.pack("<I", i)) for i in range(200)]
    name, data = _f32_tensor("w")
    (models_dir / "many_kv.gguf").write_bytes(raw_gguf(kvs, [name], data))
    server: ServeProcess = hoist_serve(HOIST_MAX_TENSORS="100", HOIST_MAX_KV_PAIRS="100")
    with httpx.Client(base_url=server.url, timeout=60) as client:
        body = is_problem(client.post("/v1/plans", json={"model": "many.gguf"}), 422, "header_too_large")
        assert "200 tensor infos" in body["detail"]
        body = is_problem(client.post("/v1/plans", json={"model": "many_kv.gguf"}), 422, "header_too_large")
        assert "200 KV pairs" in body["detail"]


def test_planning_interleaved_tensors_is_linear(live_server_emu: str, models_dir: Path) -> None:
    # alternating offloaded and CPU tensors make one mapped range per CPU tensor: tens of
    # thousands of ranges, each holding one of tens of thousands of tensors
    _many_tensors(models_dir / "inter.gguf", 40_000, interleave=True)
    with httpx.Client(base_url=live_server_emu, timeout=120) as client:
        resp = client.post("/v1/plans?tensors=false", json={"model": "inter.gguf", "n_gpu_layers": 99})
        assert resp.status_code == 200, resp.text[:300]
        plan = resp.json()
        assert "tensors" not in plan
        assert sum(1 for b in plan["buffers"] if b["name"] == "CPU_Mapped") == 20_000


def _splits(models_dir: Path, prefix: str, n: int, *, pad_to: int = 0) -> Path:
    """A model of ``n`` splits of one F32 tensor each; each file extended (sparse) to
    ``pad_to`` bytes when given. Returns the first split."""
    for i in range(n):
        kv = [
            gguf_kv("split.no", V.UINT16, struct.pack("<H", i)),
            gguf_kv("split.count", V.UINT16, struct.pack("<H", n)),
        ]
        if i == 0:
            kv = [
                gguf_kv("general.architecture", V.STRING, gguf_string("llama")),
                gguf_kv("split.tensors.count", V.INT32, struct.pack("<i", n)),
                *kv,
            ]
        name, data = _f32_tensor(f"t{i}")
        path = models_dir / f"{prefix}-{i + 1:05d}-of-{n:05d}.gguf"
        path.write_bytes(raw_gguf(kv, [name], data))
        if pad_to:
            os.truncate(path, pad_to)
    return models_dir / f"{prefix}-00001-of-{n:05d}.gguf"


def test_planning_many_splits_is_linear(hoist_serve: Any, models_dir: Path) -> None:
    first = _splits(models_dir, "sp", 600)
    server: ServeProcess = hoist_serve(HOIST_MAX_SPLITS="600")
    with httpx.Client(base_url=server.url, timeout=120) as client:
        assert client.post("/v1/plans?tensors=false", json={"model": first.name}).status_code == 200
        resp = client.post("/v1/loads", json={"model": first.name, "load_mode": "mmap"})
        assert wait_for(client, resp.headers["location"], ENDED)["state"] == "succeeded"
        # a resident model holds mappings, not descriptors
        assert sum(fds_on(p) for p in models_dir.glob("sp-*.gguf")) == 0


def test_splits_are_bounded_in_number_and_in_bytes_read(live_server: str, models_dir: Path) -> None:
    many = _splits(models_dir, "many", 300)
    # 100 small headers, each file padded to 8 MiB: reading each in large chunks would
    # read far more than the headers' bytes
    padded = _splits(models_dir, "pad", 100, pad_to=8 << 20)
    with httpx.Client(base_url=live_server, timeout=120) as client:
        body = is_problem(client.post("/v1/plans", json={"model": many.name}), 422, "header_too_large")
        assert "300" in body["detail"] and "256" in body["detail"]
        assert client.post("/v1/plans?tensors=false", json={"model": padded.name}).status_code == 200
    from service.loader.gguf import HeaderLimits
    from service.loader.weights import open_model

    index = open_model(padded, limits=HeaderLimits(max_bytes=8 << 20))
    # each file is read in a first chunk of at most 64 KiB, not as far as it goes
    assert sum(f.nbytes_read for f in index.files) <= 100 * (64 << 10)
    # a budget the headers' bytes fit in but chunked reads would not
    with pytest.raises(HeaderTooLargeError, match="larger together than the limit"):
        open_model(padded, limits=HeaderLimits(max_bytes=sum(f.data_offset for f in index.files) + 4096))


def test_a_symbolic_link_swapped_after_the_check_cannot_lead_outside(tmp_path: Path, models_dir: Path) -> None:
    from service.api.jobs import JobManager, PlacementFlags
    from service.loader.devices import CPUDevice
    from service.loader.weights import open_model

    outside = tmp_path / "outside.gguf"
    name, data = _f32_tensor("SECRET_TENSOR")
    outside.write_bytes(raw_gguf([], [name], data))
    link = models_dir / "link.gguf"
    link.symlink_to(outside)
    with pytest.raises(RequestError, match="outside the models directory"):
        open_model(link, root=str(models_dir))

    async def swapped() -> None:
        jobs = JobManager(str(models_dir), [CPUDevice()])
        try:
            # the path checked out, then became a link out of the models directory
            from service.api import jobs as jobs_module

            async def resolved(models: str, model: str) -> str:
                return str(link)

            real, jobs_module.resolve_model_path = jobs_module.resolve_model_path, resolved
            try:
                with pytest.raises(RequestError, match="outside the models directory"):
                    await jobs.plan_model("link.gguf", PlacementFlags())
            finally:
                jobs_module.resolve_model_path = real
        finally:
            await jobs.close()

    asyncio.run(swapped())


def test_ended_jobs_keep_a_summary_not_their_plan(live_server: str, models_dir: Path) -> None:
    _many_tensors(models_dir / "m.gguf", 50)
    with httpx.Client(base_url=live_server, timeout=60) as client:
        resp = client.post("/v1/loads", json={"model": "m.gguf"})
        job = wait_for(client, resp.headers["location"], ENDED)
        plan_url = f"{resp.headers['location']}/plan"
        assert len(client.get(plan_url).json()["tensors"]) == 50
        cpu = next(d for d in client.get("/v1/devices").json()["data"] if d["name"] == "CPU")
        assert cpu["reserved_bytes"] >= 50 * 4096  # the resident model's metadata
        assert client.delete(f"/v1/models/{job['model_id']}").status_code == 200
        is_problem(client.get(plan_url), 410, "gone")
        summary = client.get(resp.headers["location"]).json()["plan"]
        assert summary["lines"] == job["plan"]["lines"] and summary["n_layer"] == 0
        cpu = next(d for d in client.get("/v1/devices").json()["data"] if d["name"] == "CPU")
        assert cpu["reserved_bytes"] == 0


def test_an_abandoned_plan_of_many_tensors_stops(hoist_serve: Any, models_dir: Path) -> None:
    _many_tensors(models_dir / "inter.gguf", 60_000, interleave=True)
    server: ServeProcess = hoist_serve(HOIST_EMULATED_DEVICES="EMU0=1GiB")
    with httpx.Client(base_url=server.url) as client, pytest.raises(httpx.ReadTimeout):
        client.post("/v1/plans", json={"model": "inter.gguf", "n_gpu_layers": 99}, timeout=0.3)
    time.sleep(1.5)  # the work notices within a slice of tensors
    cpu = server.cpu_seconds()
    time.sleep(1.0)
    assert server.cpu_seconds() - cpu < 0.3  # idle again


def test_listings_are_paged_and_compact(live_server: str, models_dir: Path) -> None:
    _many_tensors(models_dir / "m.gguf", 20)
    with httpx.Client(base_url=live_server, timeout=60) as client:
        ids = []
        for i in range(3):  # three copies, by three names
            resp = client.post("/v1/loads", json={"model": "m.gguf", "load_mode": "mmap", "name": f"m{i}"})
            assert resp.status_code == 202, resp.text
            ids.append(wait_for(client, resp.headers["location"], ENDED)["id"])
        page = client.get("/v1/loads", params={"limit": 2, "offset": 1}).json()
        assert page["total"] == 3 and [j["id"] for j in page["data"]] == ids[1:]
        assert client.get("/v1/loads", params={"offset": 5}).json() == {"data": [], "total": 3}
        is_problem(client.get("/v1/loads", params={"limit": 0}), 422)
        is_problem(client.get("/v1/loads", params={"limit": 10**6}), 422)
        is_problem(client.get("/v1/loads", params={"offset": 10**30}), 422)
        # listings carry a summary of the memory, the model itself its report
        models = client.get("/v1/models").json()["data"]
        assert len(models) == 3
        for m in models:
            assert "memory" not in m
            full = client.get(f"/v1/models/{m['id']}").json()["memory"]
            assert m["memory_summary"]["total_bytes"] == full["total_bytes"] > 0
            assert m["memory_summary"]["n_buffers"] == len(full["buffers"])
