"""CUDA through PyTorch: run where a GPU is present, skipped elsewhere."""

from __future__ import annotations

import asyncio
from pathlib import Path

import gguf
import numpy as np
import pytest

from service.loader.devices import discover_devices
from service.loader.devices.cuda import cuda_devices
from service.loader.pipeline import load_model
from service.loader.placement import MemorySnapshot, make_params, plan
from service.loader.weights import open_model
from tests.helpers import Fixture

torch = pytest.importorskip("torch", reason="the cuda extra is not installed")

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"),
]


def test_cuda_devices_are_discovered() -> None:
    devs = cuda_devices()
    assert devs and devs[0].name == "CUDA0"
    mem = devs[0].memory()
    assert 0 < mem.free <= mem.total
    assert devs[0].host_buffer_type is not None and devs[0].host_buffer_type.name == "CUDA_Host"
    assert devs[0].caps.async_ and devs[0].caps.events


@pytest.mark.parametrize("mode", ["mmap", "none"])
def test_fixture_on_cuda_matches_the_file(all_types_fixture: Fixture, mode: str) -> None:
    devs = discover_devices(None)
    params = make_params([d.default_buffer_type.name for d in devs], n_gpu_layers="all", load_mode=mode)
    reader = gguf.GGUFReader(all_types_fixture.path)
    with asyncio.run(load_model(open_model(all_types_fixture.path), devices=devs, params=params)) as model:
        for ref in reader.tensors:
            t = model[ref.name]
            data = t.data.cpu().numpy() if hasattr(t.data, "cpu") else t.data
            assert np.asarray(data).tobytes() == np.asarray(ref.data).tobytes(), ref.name


@pytest.mark.sample
def test_sample_plan_on_cuda(sample_path: Path) -> None:
    devs = discover_devices(None)
    params = make_params([d.default_buffer_type.name for d in devs], n_gpu_layers=99, load_mode="none")
    p = plan(open_model(sample_path), devs, params, memory=MemorySnapshot.take(devs))
    assert p.devices[0] == "CUDA0"
    assert {b.name for b in p.buffers} >= {"CUDA0", "CUDA_Host"}
