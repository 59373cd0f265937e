"""Where tensors lie in host buffers: packed as llama.cpp lays them out, with slack around
large runs for direct reads only; the plan counts what is really allocated."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from service.io.align import align_up
from service.loader.devices import CPUDevice
from service.loader.pipeline import load_model
from service.loader.placement import MemorySnapshot, make_params, plan
from service.loader.placement.buffers import DIRECT_RUN_MIN_NBYTES, RUN_ALIGNMENT, TensorPlacement, host_layout
from service.loader.weights import open_model
from tests.helpers import write_fixture
from tests.loader.test_load_modes import assert_bytes_equal_file


def _t(name: str, offset: int, nbytes: int, file_index: int = 0) -> TensorPlacement:
    return TensorPlacement(name, "F32", nbytes, file_index, offset, "input", "input", "GET_ROWS", "CPU", "CPU")


def test_packed_without_direct_io() -> None:
    # a run of two, then a tensor after a gap: packed all the same, as llama.cpp lays them out
    tensors = [_t("a", 1000, 40), _t("b", 1056, 100), _t("c", 9000, 8)]
    layout = host_layout(tensors, 32, direct=False)
    assert layout.offsets == (0, 64, 192)
    assert layout.nbytes == sum(align_up(t.nbytes, 32) for t in tensors)
    assert layout.slack == (False, False, False)


def test_direct_io_gives_slack_to_large_runs_only() -> None:
    big = DIRECT_RUN_MIN_NBYTES
    tensors = [_t("small", 100, 64), _t("big1", 5000, big), _t("big2", 5000 + big, 96), _t("tiny", 10**7, 8)]
    layout = host_layout(tensors, 32, direct=True)
    small, big1, big2, tiny = layout.offsets
    assert layout.slack == (False, True, True, False)
    assert small == 0
    # the large run starts congruent to its file offset, with a block of room before it
    assert big1 % RUN_ALIGNMENT == 5000 % RUN_ALIGNMENT and big1 >= 64 + RUN_ALIGNMENT
    assert big2 == big1 + big
    # and a block of room after it
    assert tiny >= big2 + 96 + RUN_ALIGNMENT
    assert layout.nbytes == tiny + 32


@pytest.mark.parametrize("mode", ["none", "direct-io"])
def test_many_small_tensors_cost_their_bytes_not_pages(tmp_path: Path, mode: str) -> None:
    # 2000 tensors of 32 bytes, padded to 64 in the file: none of them forms a run with the next
    rng = np.random.default_rng(0)
    tensors = {f"t{i}": (rng.standard_normal(8).astype(np.float32), Q.F32) for i in range(2000)}
    path = write_fixture(tmp_path / "m.gguf", tensors=tensors, alignment=64).path
    p = plan(
        open_model(path), [CPUDevice()], make_params([], load_mode=mode), memory=MemorySnapshot.take([CPUDevice()])
    )
    (cpu,) = p.device_use
    assert cpu.allocated == sum(b.alloc_nbytes for b in p.buffers) <= 2000 * 64 + RUN_ALIGNMENT
    with asyncio.run(load_model(open_model(path), load_mode=mode)) as model:
        assert_bytes_equal_file(model, path)


def test_direct_io_reads_a_large_run_in_place(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    tensors = {
        "a": (rng.standard_normal(8).astype(np.float32), Q.F32),
        "b": (rng.standard_normal(50_000).astype(np.float32), Q.F32),
        "c": (rng.standard_normal(7).astype(np.float32), Q.F32),
        "d": (rng.standard_normal(70_001).astype(np.float32), Q.F32),
    }
    path = write_fixture(tmp_path / "m.gguf", tensors=tensors).path
    p = plan(
        open_model(path),
        [CPUDevice()],
        make_params([], load_mode="direct-io"),
        memory=MemorySnapshot.take([CPUDevice()]),
    )
    (buf,) = p.buffers
    assert buf.alloc_nbytes > buf.nbytes  # room around the large run
    (cpu,) = p.device_use
    assert cpu.allocated == buf.alloc_nbytes
    with asyncio.run(load_model(open_model(path), load_mode="direct-io")) as model:
        assert_bytes_equal_file(model, path)
        assert model.stats.direct_io  # this file system takes O_DIRECT; else the test proves less
