"""What a plan is a function of: the file, the flags (each spelled as llama.cpp spells it)
and a snapshot of the devices' memory taken once by the caller, never live figures."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.errors import PlacementError, RequestError
from service.loader.devices import CPUDevice, DeviceMemory, EMUDevice
from service.loader.placement import LazyMode, LoadMode, MemorySnapshot, SplitMode, make_params, plan
from service.loader.placement.params import INT32_MAX, INT32_MIN, parse_n_gpu_layers
from service.loader.weights import open_model
from tests.helpers import block_model

MiB = 1 << 20


class DriftingEMU(EMUDevice):
    """An emulated GPU whose free memory changes at every read, as a shared GPU's does."""

    def __init__(self, index: int, total: int) -> None:
        super().__init__(index, total)
        self.reads = 0

    def memory(self) -> DeviceMemory:
        self.reads += 1
        return DeviceMemory(free=self.total - self.reads * 7 * MiB, total=self.total)


class DriftingCPU(CPUDevice):
    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def memory(self) -> DeviceMemory:
        self.reads += 1
        return DeviceMemory(free=(64 << 30) - self.reads * MiB, total=64 << 30)


def test_a_plan_reads_only_its_snapshot(tmp_path: Path) -> None:
    path = block_model(tmp_path / "m.gguf", 8)
    cpu, a, b = DriftingCPU(), DriftingEMU(0, 3000 * MiB), DriftingEMU(1, 1000 * MiB)
    devs = [cpu, a, b]
    params = make_params([d.default_buffer_type.name for d in devs], n_gpu_layers=7)
    memory = MemorySnapshot.take(devs)
    assert (cpu.reads, a.reads, b.reads) == (1, 1, 1)
    first = plan(open_model(path), devs, params, memory=memory)
    second = plan(open_model(path), devs, params, memory=memory)
    assert (cpu.reads, a.reads, b.reads) == (1, 1, 1)  # no live read while planning
    assert first.to_dict() == second.to_dict()
    # the split and the free figures are the snapshot's
    free = {name: m.free for name, m in memory.devices.items()}
    assert first.splits == pytest.approx((free["EMU0"] / (free["EMU0"] + free["EMU1"]), 1.0), rel=1e-6)
    assert {u.device: u.free for u in first.device_use} == {n: free[n] for n in ("CPU", "EMU0", "EMU1")}
    # another snapshot (other free memory) gives another plan: the snapshot is an input
    later = plan(open_model(path), devs, params, memory=MemorySnapshot.take(devs))
    assert {u.device: u.free for u in later.device_use} != {u.device: u.free for u in first.device_use}


def test_a_snapshot_of_other_devices_is_refused(tmp_path: Path) -> None:
    path = block_model(tmp_path / "m.gguf", 2)
    devs = [CPUDevice(), EMUDevice(0, 1 << 30)]
    with pytest.raises(PlacementError, match="no memory figures for device EMU0"):
        plan(open_model(path), devs, make_params(["CPU", "EMU0"]), memory=MemorySnapshot.take(devs[:1]))


# -- flag spellings -----------------------------------------------------------------------------


def test_each_flag_has_canonical_names_and_aliases() -> None:
    assert LoadMode.parse("dio") is LoadMode.DIRECT_IO is LoadMode.parse("direct-io")
    assert LoadMode.spellings() == ("auto", "none", "mmap", "mlock", "mmap+mlock", "direct-io", "dio")
    assert SplitMode.spellings() == ("none", "layer", "row") and LazyMode.spellings() == ("off", "auto", "on")
    assert make_params([], load_mode="dio").load_mode is LoadMode.DIRECT_IO
    with pytest.raises(RequestError, match=r"unknown load mode 'DIO' \(expected one of: .*direct-io, dio\)"):
        LoadMode.parse("DIO")
    with pytest.raises(RequestError, match="unknown split mode 'tensor'"):
        SplitMode.parse("tensor")


@pytest.mark.parametrize(
    ("mode", "use_mmap", "label"),
    [
        ("auto", True, "auto -> mmap"),
        ("mmap", True, "mmap"),
        ("none", False, "none"),
        ("mlock", False, "mlock"),
        ("mmap+mlock", True, "mmap+mlock"),
        ("dio", False, "direct-io"),
    ],
)
def test_one_label_per_load_mode(tmp_path: Path, mode: str, use_mmap: bool, label: str) -> None:
    path = block_model(tmp_path / "m.gguf", 2)
    devs = [CPUDevice()]
    p = plan(open_model(path), devs, make_params([], load_mode=mode), memory=MemorySnapshot.take(devs))
    assert p.use_mmap is use_mmap and p.load_mode_label == label
    assert p.to_dict()["effective_load_mode"] == label.split(" -> ")[-1]


def test_auto_without_mapping_is_labelled_so(tmp_path: Path) -> None:
    path = block_model(tmp_path / "m.gguf", 2)
    devs = [CPUDevice(), EMUDevice(0, 1 << 30, mmap_support=False)]
    p = plan(open_model(path), devs, make_params(["CPU", "EMU0"]), memory=MemorySnapshot.take(devs))
    assert p.load_mode_label == "auto -> none"


# -- n_gpu_layers as numbers (the API's JSON) ---------------------------------------------------


def test_n_gpu_layers_numbers() -> None:
    assert parse_n_gpu_layers(None) is None
    assert parse_n_gpu_layers(0) == 0 and parse_n_gpu_layers(INT32_MAX) == INT32_MAX
    assert parse_n_gpu_layers(-1) is None and parse_n_gpu_layers(INT32_MIN) is None
    for bad in (INT32_MAX + 1, INT32_MIN - 1, True, 2.0, "9" * 5000):
        with pytest.raises(RequestError, match="invalid n_gpu_layers"):
            parse_n_gpu_layers(bad)  # type: ignore[arg-type]
