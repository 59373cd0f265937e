"""The in-process API: a load followed as events, and cancelled by its progress callback
at several points, everything it took released each time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from service.api.event_schema import LoadEvent
from service.api.local import LocalLoad
from service.errors import LoadCancelledError
from service.loader.devices import EMUDevice, discover_devices
from service.loader.pipeline import LoadOptions, Progress
from service.loader.placement import LoadMode, PlacementParams
from service.loader.weights import open_model
from tests.helpers import write_fixture
from tests.resources import fds_on, load_threads, mappings_of

ROOT = Path(__file__).resolve().parents[2]
LAYER = 256 << 10


def _model(path: Path) -> Path:
    tensors = {
        "token_embd.weight": (np.ones(64, dtype=np.float32), Q.F32),
        **{f"blk.{i}.attn_q.weight": (np.full(LAYER // 4, i, dtype=np.float32), Q.F32) for i in range(4)},
    }
    write_fixture(path, kv=[("llama.block_count", 4, V.UINT32, None)], tensors=tensors)
    return path


def _load(path: Path, mode: LoadMode, on_progress=None) -> tuple[LocalLoad, list]:  # type: ignore[no-untyped-def]
    devices = discover_devices("EMU0=16MiB", cuda=False)
    load = LocalLoad(
        open_model(path),
        devices=devices,
        params=PlacementParams(n_gpu_layers=3, load_mode=mode),
        options=LoadOptions(chunk_nbytes=32 << 10, staging_buffers=2, staging_nbytes=32 << 10),
        on_progress=on_progress,
    )
    return load, devices


@pytest.mark.parametrize("mode", [LoadMode.MMAP, LoadMode.NONE])
async def test_events_of_a_local_load(tmp_path: Path, mode: LoadMode) -> None:
    load, devices = _load(_model(tmp_path / "m.gguf"), mode)
    events = [e.json() async for e in load.events()]
    for e in events:
        LoadEvent.model_validate(e)
    assert events[0]["event"] == "snapshot" and events[-1]["event"] == "report"
    with await load.result() as model:
        # the bytes per device the events tell are those of the tensors the model placed there
        placed: dict[str, int] = {}
        for t in [*model, *([model.tied_output] if model.tied_output is not None else [])]:
            placed[t.device] = placed.get(t.device, 0) + t.nbytes
        assert events[-1]["by_device"] == placed
        assert events[-1]["report"]["memory_summary"]["total_bytes"] == model.report.total_nbytes
    assert all(d.allocated == 0 for d in devices if isinstance(d, EMUDevice))


@pytest.mark.parametrize("mode", [LoadMode.MMAP, LoadMode.NONE])
@pytest.mark.parametrize("stop_at", [0, 1, 3, -1])
async def test_cancel_from_the_callback_at_several_points(tmp_path: Path, mode: LoadMode, stop_at: int) -> None:
    """``stop_at``: the call that returns False (0: the one before any byte moves; -1: the
    last one, with every byte in place)."""
    path = _model(tmp_path / "m.gguf")
    calls: list[Progress] = []

    def on_progress(p: Progress) -> bool:
        calls.append(p)
        if stop_at == -1:
            return p.bytes_done < p.bytes_total
        return len(calls) <= stop_at

    load, devices = _load(path, mode, on_progress)
    events = [e.json() async for e in load.events()]
    with pytest.raises(LoadCancelledError):
        await load.result()
    assert events[-1]["event"] == "state" and events[-1]["state"] == "cancelled" and events[-1]["final"]
    if stop_at == -1:
        assert calls[-1].bytes_done == calls[-1].bytes_total
    else:
        assert len(calls) == stop_at + 1
    assert mappings_of(path) == 0 and fds_on(path) == 0 and load_threads() == 0
    assert all(d.allocated == 0 for d in devices if isinstance(d, EMUDevice))


@pytest.mark.parametrize("stop_at", [None, "0.5"])
def test_the_python_api_example_runs(tmp_path: Path, stop_at: str | None) -> None:
    path = _model(tmp_path / "m.gguf")
    cmd = [sys.executable, str(ROOT / "examples" / "python_api.py"), str(path)]
    if stop_at:
        cmd += ["--stop-at", stop_at]
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120, env={"PYTHONPATH": str(ROOT)})
    lines = run.stdout.splitlines()
    assert lines[0].startswith("snapshot"), run.stdout + run.stderr
    if stop_at:
        assert run.returncode == 1 and lines[-1].startswith("cancelled:"), run.stdout + run.stderr
        assert lines[-2].startswith("state")
    else:
        assert run.returncode == 0, run.stderr
        assert any(line.startswith("report") for line in lines)
        assert any("EMU0" in line and "MiB" in line for line in lines[-4:]), lines
