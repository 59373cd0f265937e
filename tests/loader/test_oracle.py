"""Conformance with what llama.cpp itself decided on the bundled real models
(tests/data/oracle_configs.json): for every recorded configuration, the same flags on
emulated devices of the same sizes give the same device per layer, the same
``model buffer size`` lines and offload lines, or the same error."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from service.cli import devices_for, parse_args, placement_params
from service.errors import HoistError
from service.loader.placement import MemorySnapshot, plan
from service.loader.weights import WeightIndex, open_model
from tests.helpers import split_gguf

ORACLE = json.loads((Path(__file__).resolve().parent.parent / "data" / "oracle_configs.json").read_text())

pytestmark = pytest.mark.sample


# the record's ``model`` -> the bundled model and, for a split, the tensors per file
MODELS: dict[str, tuple[str, list[int] | None]] = {
    "sample": ("gemma3", None),
    "sample-split-3": ("gemma3", [100, 100, 36]),
    "smollm2": ("smollm2", None),
    "smollm2-split-3": ("smollm2", [100, 100, 72]),
}


@pytest.fixture(scope="module")
def models(
    sample_file: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], WeightIndex]:
    """``models(name)``: the weights index of a record's model, opened once per module."""
    opened: dict[str, WeightIndex] = {}

    def get(name: str) -> WeightIndex:
        if name not in opened:
            sample, split = MODELS[name]
            path = sample_file(sample)
            if split is not None:
                path = split_gguf(path, tmp_path_factory.mktemp(name) / sample, split)[0]
            opened[name] = open_model(path)
        return opened[name]

    return get


def _emulated(record: dict[str, Any]) -> str:
    return ",".join(f"{d['name']}={d['memory']}" for d in record["devices"])


@pytest.mark.parametrize("name", sorted(ORACLE))
def test_oracle_record(name: str, models: Callable[[str], WeightIndex]) -> None:
    record = ORACLE[name]
    args = parse_args(
        ["plan", "MODEL", "--no-cuda", "--emulated-devices", _emulated(record), *shlex.split(record["flags"])]
    )
    devices = devices_for(args)
    if record.get("error"):
        with pytest.raises(HoistError) as info:
            plan(models(record["model"]), devices, placement_params(args, devices), memory=MemorySnapshot.take(devices))
        expected = record["error"][0]
        if "unknown buffer type" in expected:
            assert "unknown buffer type 'FOO'" in str(info.value)
        else:
            assert expected.split("error loading model: ")[1].replace("RPC0", "EMU0") in str(info.value)
        return
    p = plan(models(record["model"]), devices, placement_params(args, devices), memory=MemorySnapshot.take(devices))
    assert p.layers == record["layers"]
    assert [(b.name, round(b.nbytes / (1 << 20), 2)) for b in p.buffers] == [
        (b["buffer"], b["MiB"]) for b in record["model_buffers"]
    ]
    assert p.offload_lines() == record["offload_lines"]
    assert p.fits


@pytest.mark.parametrize(
    ("name", "layers"),
    [
        ("A10", "input CPU; blk.0-8 CPU; blk.9-13 EMU0; blk.14-17 EMU1; output EMU1"),
        ("M10", "input CPU; blk.0-20 CPU; blk.21-25 EMU0; blk.26-29 EMU1; output EMU1"),
    ],
)
def test_hoist_plan_prints_llama_cpp_lines(name: str, layers: str, sample_file: Callable[[str], Path]) -> None:
    record = ORACLE[name]
    result = subprocess.run(
        [sys.executable, "-m", "service.cli", "plan", str(sample_file(MODELS[record["model"]][0])), "--no-cuda",
         "--emulated-devices", _emulated(record), *shlex.split(record["flags"])],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    expected = record["offload_lines"] + [
        f"{b['buffer']:>12} model buffer size = {b['MiB']:8.2f} MiB" for b in record["model_buffers"]
    ]
    assert result.stdout.splitlines() == expected
    assert f"layers: {layers}" in result.stderr
