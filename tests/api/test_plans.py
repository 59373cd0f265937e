"""Placement over HTTP: dry-run plans, loads onto emulated devices, per-device memory."""

from __future__ import annotations

import httpx

from tests.api.test_loads import wait_for
from tests.helpers import block_model


def test_plan_and_load_on_emulated_devices(live_server_emu: str, models_dir) -> None:  # type: ignore[no-untyped-def]
    block_model(models_dir / "m.gguf", 8, output=False, elements=4096)
    flags = {"n_gpu_layers": 6, "tensor_split": [1, 1], "load_mode": "none", "no_host": True}
    with httpx.Client(base_url=live_server_emu) as client:
        resp = client.post("/v1/plans", json={"model": "m.gguf", **flags})
        assert resp.status_code == 200, resp.text
        planned = resp.json()
        assert planned["devices"] == ["EMU0", "EMU1"] and planned["fits"]
        assert planned["layers"]["blk.2"] == "CPU" and planned["layers"]["blk.3"] == "EMU0"
        assert planned["layers"]["output"] == "EMU1"
        assert planned["offload_lines"][-1] == "offloaded 6/9 layers to GPU"
        names = [b["name"] for b in planned["buffers"]]
        assert names == ["CPU", "EMU0", "EMU1"]
        assert sum(1 for t in planned["tensors"] if t["role"] == "tied_output") == 1

        resp = client.post("/v1/loads", json={"model": "m.gguf", **flags})
        assert resp.status_code == 202, resp.text
        assert resp.json()["plan"]["lines"] == planned["lines"]
        done = wait_for(client, resp.headers["location"], {"succeeded", "failed"})
        assert done["state"] == "succeeded", done
        assert [(b["buffer_type"], b["bytes"]) for b in done["memory"]["buffers"]] == [
            (b["name"], b["bytes"]) for b in planned["buffers"]
        ]
        devices = {d["name"]: d for d in client.get("/v1/devices").json()["data"]}
        for b in planned["buffers"]:
            if b["name"].startswith("EMU"):
                d = devices[b["name"]]
                assert d["used_by_models_bytes"] == b["bytes"]
                assert d["total_bytes"] - d["free_bytes"] == b["bytes"]
        assert devices["EMU0"]["caps"]["async"] and devices["EMU0"]["buffer_types"] == ["EMU0", "EMU_Host"]
        client.delete(f"/v1/models/{done['model_id']}")
        devices = {d["name"]: d for d in client.get("/v1/devices").json()["data"]}
        assert devices["EMU0"]["free_bytes"] == devices["EMU0"]["total_bytes"]


def test_placement_errors_over_http(live_server_emu: str, models_dir) -> None:  # type: ignore[no-untyped-def]
    block_model(models_dir / "m.gguf", 4, elements=1 << 20)  # 4 MiB tensors
    with httpx.Client(base_url=live_server_emu) as client:
        bad = client.post("/v1/plans", json={"model": "m.gguf", "override_tensor": ["attn=FOO"]})
        assert bad.status_code == 400 and "available buffer types: CPU, EMU0, EMU1" in bad.json()["detail"]
        row = client.post("/v1/loads", json={"model": "m.gguf", "split_mode": "row"})
        assert row.status_code == 400 and "does not support split buffers" in row.json()["detail"]
        mg = client.post("/v1/plans", json={"model": "m.gguf", "split_mode": "none", "main_gpu": 5})
        assert mg.status_code == 400 and "invalid value for main_gpu: 5" in mg.json()["detail"]
        # EMU1 (32 MiB) cannot hold everything: the plan says so, the load is refused
        plan = client.post("/v1/plans", json={"model": "m.gguf", "tensor_split": [0, 1]}).json()
        assert plan["fits"] is False
        refused = client.post("/v1/loads", json={"model": "m.gguf", "tensor_split": [0, 1]})
        assert refused.status_code == 409 and refused.json()["code"] == "insufficient_device_memory"
        assert "EMU1 needs" in refused.json()["detail"]
        assert client.get("/healthz").status_code == 200


def test_check_tensors_over_http(live_server_emu: str, models_dir) -> None:  # type: ignore[no-untyped-def]
    from tests.loader.test_load_modes import bad_model

    bad_model(models_dir / "bad.gguf")
    with httpx.Client(base_url=live_server_emu) as client:
        body = {"model": "bad.gguf", "n_gpu_layers": "all", "load_mode": "direct-io", "check_tensors": True}
        resp = client.post("/v1/loads", json=body)
        assert resp.status_code == 202, resp.text
        done = wait_for(client, resp.headers["location"], {"succeeded", "failed"})
        assert done["state"] == "failed"
        assert done["error"]["code"] == "invalid_tensor_data"
        assert set(done["error"]["tensors"]) == {"blk.0.ffn_up.weight", "token_embd.weight", "blk.0.attn_q.weight"}
        devices = {d["name"]: d for d in client.get("/v1/devices").json()["data"]}
        assert all(devices[n]["free_bytes"] == devices[n]["total_bytes"] for n in ("EMU0", "EMU1"))
        body["check_tensors"] = False
        ok = wait_for(client, client.post("/v1/loads", json=body).headers["location"], {"succeeded", "failed"})
        assert ok["state"] == "succeeded" and ok["stats"]["bytes_by_branch"]
