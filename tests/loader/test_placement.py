"""Placement rules, as llama.cpp applies them: devices, splits, layers, buffer type lists,
overrides, capabilities, tied output, mapped ranges, budgets (cases P01-P05)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest

from service.errors import BudgetExceededError, OutOfMemoryError, PlacementError
from service.loader.devices import CPUDevice, Device, EMUDevice, discover_devices
from service.loader.pipeline import load_model, load_plan
from service.loader.placement import MemorySnapshot, Plan, make_params, plan
from service.loader.placement.devices import layer_device, select_devices, split_points
from service.loader.weights import open_model
from tests.helpers import block_model

MiB = 1 << 20


def devices(spec: str) -> list[Device]:
    return discover_devices(spec, cuda=False)


def make_plan(path: Path, spec: str, **flags: object) -> Plan:
    devs = devices(spec)
    params = make_params([d.default_buffer_type.name for d in devs], **flags)  # type: ignore[arg-type]
    return plan(open_model(path), devs, params, memory=MemorySnapshot.take(devs))


def blocks_on(p: Plan) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for key, dev in p.layers.items():
        if key.startswith("blk."):
            out.setdefault(dev, []).append(int(key[4:]))
    return out


# -- devices and splits -------------------------------------------------------------------


class FakeGPU(EMUDevice):
    def __init__(self, index: int, device_id: str, *, kind: str = "GPU", backend: str = "X", free: int = 1 << 30):
        super().__init__(index, free)
        self.name = f"GPU{index}"
        self.type = kind
        self.backend = backend
        self.remote = False
        self.device_id = device_id


def test_device_order_and_dedupe() -> None:
    cpu = CPUDevice()
    emu = EMUDevice(0, 1 << 30)
    g0, g0_again, g1 = FakeGPU(0, "pci:1"), FakeGPU(1, "pci:1"), FakeGPU(2, "pci:2")
    igpu = FakeGPU(3, "pci:9", kind="IGPU")
    params = make_params([])
    assert [d.name for d in select_devices([cpu, g0, g0_again, igpu, g1, emu], params)] == ["EMU0", "GPU0", "GPU2"]
    # integrated GPUs only without a discrete one
    assert [d.name for d in select_devices([cpu, igpu], params)] == ["GPU3"]


def test_split_mode_none_keeps_main_gpu() -> None:
    devs = devices("EMU0=1GiB,EMU1=1GiB")
    assert [d.name for d in select_devices(devs, make_params([], split_mode="none", main_gpu=1))] == ["EMU1"]
    assert select_devices(devs, make_params([], split_mode="none", main_gpu=-1)) == []
    with pytest.raises(PlacementError, match="invalid value for main_gpu: 2 \\(available devices: 2\\)"):
        select_devices(devs, make_params([], split_mode="none", main_gpu=2))


def test_split_points() -> None:
    cpu = CPUDevice()
    a, b = EMUDevice(0, 3000 * MiB), EMUDevice(1, 1000 * MiB)
    zero = EMUDevice(2, 0)
    memory = MemorySnapshot.take([cpu, a, b, zero])
    assert split_points([a, b], None, cpu, memory) == [0.75, 1.0]
    assert split_points([a, b], (0.0, 0.0), cpu, memory) == [0.75, 1.0]  # all zero: by free memory
    assert split_points([a, b], (1, 3), cpu, memory) == [0.25, 1.0]
    assert split_points([a, b], (2,), cpu, memory) == [1.0, 1.0]  # missing values are 0
    with pytest.raises(PlacementError, match="tensor_split has 3 values but 2 devices"):
        split_points([a, b], (1, 1, 1), cpu, memory)
    # a device reporting 0/0 weighs the host's free memory (as the snapshot has it)
    host_free = memory.of(cpu.name).free
    points = split_points([zero, a], None, cpu, memory)
    assert points[0] == pytest.approx(host_free / (host_free + 3000 * MiB), rel=1e-6)


def test_layer_assignment_rule() -> None:
    devs = devices("EMU0=1GiB,EMU1=1GiB")
    points = [0.5, 1.0]
    n_layer = 4
    assert [layer_device(il, n_layer, 0, devs, points) for il in range(5)] == [-1] * 5
    assert [layer_device(il, n_layer, 1, devs, points) for il in range(5)] == [-1, -1, -1, -1, 0]
    assert [layer_device(il, n_layer, 99, devs, points) for il in range(5)] == [0, 0, 0, 1, 1]
    assert [layer_device(il, n_layer, 99, [], points) for il in range(5)] == [-1] * 5


# -- P01, P02: layers -----------------------------------------------------------------------


def test_p01_four_blocks_even_split(tmp_path: Path) -> None:
    p = make_plan(block_model(tmp_path / "m.gguf", 4), "EMU0=1GiB,EMU1=1GiB", n_gpu_layers=99, tensor_split="1,1")
    assert blocks_on(p) == {"EMU0": [0, 1, 2], "EMU1": [3]}
    assert p.layers["output"] == "EMU1" and p.layers["input"] == "CPU"


def test_p01_39_blocks_uneven_split(tmp_path: Path) -> None:
    p = make_plan(
        block_model(tmp_path / "m.gguf", 39), "EMU0=1GiB,EMU1=1GiB", n_gpu_layers=40, tensor_split="0.36,0.64"
    )
    assert len(blocks_on(p)["EMU0"]) == 15 and len(blocks_on(p)["EMU1"]) == 24
    assert p.layers["output"] == "EMU1"


def test_p01_partial_offload(tmp_path: Path) -> None:
    p = make_plan(block_model(tmp_path / "m.gguf", 32), "EMU0=1GiB,EMU1=1GiB", n_gpu_layers=20, tensor_split="3,1")
    assert blocks_on(p) == {"CPU": list(range(13)), "EMU0": list(range(13, 28)), "EMU1": list(range(28, 32))}
    token_embd = next(t for t in p.tensors if t.name == "token_embd.weight")
    assert token_embd.device == "CPU" and p.layers["output"] == "EMU1"


def test_p01_zero_share_device_is_empty(tmp_path: Path) -> None:
    p = make_plan(block_model(tmp_path / "m.gguf", 32), "EMU0=1GiB,EMU1=1GiB", n_gpu_layers=33, tensor_split="0,1")
    assert blocks_on(p) == {"EMU1": list(range(32))} and p.layers["output"] == "EMU1"
    assert "EMU0" not in {b.name for b in p.buffers}


@pytest.mark.parametrize(
    ("ngl", "cpu_blocks", "output", "offloaded"),
    [
        (0, 32, "CPU", "0/33"),
        (1, 32, "EMU0", "1/33"),
        (32, 1, "EMU0", "32/33"),
        (33, 0, "EMU0", "33/33"),
        (99, 0, "EMU0", "33/33"),
    ],
)
def test_p02_n_gpu_layers(tmp_path: Path, ngl: int, cpu_blocks: int, output: str, offloaded: str) -> None:
    p = make_plan(block_model(tmp_path / "m.gguf", 32), "EMU0=1GiB", n_gpu_layers=ngl)
    assert len(blocks_on(p).get("CPU", [])) == cpu_blocks
    assert p.layers["output"] == output
    assert p.offload_lines()[-1] == f"offloaded {offloaded} layers to GPU"
    if ngl == 32:
        assert blocks_on(p)["CPU"] == [0]


def test_offload_lines(tmp_path: Path) -> None:
    path = block_model(tmp_path / "m.gguf", 18)
    assert make_plan(path, "EMU0=1GiB", n_gpu_layers=0).offload_lines() == [
        "offloading 0 repeating layers to GPU",
        "offloaded 0/19 layers to GPU",
    ]
    assert make_plan(path, "EMU0=1GiB", n_gpu_layers=10).offload_lines() == [
        "offloading output layer to GPU",
        "offloading 9 repeating layers to GPU",
        "offloaded 10/19 layers to GPU",
    ]
    # llama.cpp undercounts the repeating layers by one when -ngl passes n_layer
    assert (
        make_plan(path, "EMU0=1GiB", n_gpu_layers="all").offload_lines()[1] == "offloading 17 repeating layers to GPU"
    )
    # without any GPU-like device llama.cpp prints no offload lines
    assert make_plan(path, "", n_gpu_layers=99).offload_lines() == []


# -- P03: overrides ---------------------------------------------------------------------------

EXPERTS = ("attn_q.weight", "ffn_up_exps.weight", "ffn_up_exps.bias")


def test_p03_first_override_wins(tmp_path: Path) -> None:
    path = block_model(tmp_path / "m.gguf", 12, per_block=EXPERTS)
    spec = "EMU0=1GiB,EMU1=1GiB"
    p = make_plan(path, spec, n_gpu_layers=99, override_tensor=["blk\\.(3|4)\\.=EMU0", "exps=CPU"])
    where = {t.name: t.buffer_type for t in p.tensors}
    assert where["blk.3.ffn_up_exps.weight"] == "EMU0"
    assert where["blk.5.ffn_up_exps.weight"] == "CPU" and where["blk.5.ffn_up_exps.bias"] == "CPU"
    assert where["blk.5.attn_q.weight"] == "EMU0"
    reverse = make_plan(path, spec, n_gpu_layers=99, override_tensor=["exps=CPU", "blk\\.(3|4)\\.=EMU0"])
    assert {t.name: t.buffer_type for t in reverse.tensors}["blk.3.ffn_up_exps.weight"] == "CPU"
    # comma-separated in one value is the same as repeated
    joined = make_plan(path, spec, n_gpu_layers=99, override_tensor=["blk\\.(3|4)\\.=EMU0,exps=CPU"])
    assert {t.name: t.buffer_type for t in joined.tensors} == where
    assert p.override_matches == (6, 20)
    assert any("tensor overrides to CPU are used with mmap enabled" in w for w in p.warnings)
    assert not any(
        "tensor overrides to CPU" in w
        for w in make_plan(path, spec, override_tensor=["exps=CPU"], load_mode="none").warnings
    )


def test_p03_unknown_buffer_type(tmp_path: Path) -> None:
    path = block_model(tmp_path / "m.gguf", 2)
    with pytest.raises(PlacementError, match="unknown buffer type 'FOO'.*available buffer types: CPU, EMU0, EMU1"):
        make_plan(path, "EMU0=1GiB,EMU1=1GiB", override_tensor=["attn=FOO"])
    with pytest.raises(PlacementError, match="expected PATTERN=BUFFER_TYPE"):
        make_plan(path, "EMU0=1GiB", override_tensor=["attn"])


def test_p03_override_matching_nothing(tmp_path: Path) -> None:
    p = make_plan(block_model(tmp_path / "m.gguf", 2), "EMU0=1GiB", override_tensor=["nothing=CPU"])
    assert p.override_matches == (0,)
    assert "tensor override 0 ('nothing=CPU') matched 0 tensors" in p.warnings


# -- buffer type lists and capabilities -----------------------------------------------------


def test_host_buffer_type_holds_cpu_layers_without_mmap(tmp_path: Path) -> None:
    path = block_model(tmp_path / "m.gguf", 4)
    with_host = make_plan(path, "EMU0=1GiB", n_gpu_layers=2, load_mode="none")
    assert [b.name for b in with_host.buffers] == ["EMU0", "EMU_Host"]
    assert {t.buffer_type for t in with_host.tensors if t.layer in ("input", "blk.0")} == {"EMU_Host"}
    no_host = make_plan(path, "EMU0=1GiB", n_gpu_layers=2, load_mode="none", no_host=True)
    assert [b.name for b in no_host.buffers] == ["CPU", "EMU0"]
    # under mmap the host buffer type becomes plain CPU (mapped), counted as moved
    mapped = make_plan(path, "EMU0=1GiB", n_gpu_layers=2)
    # token_embd, then (after output_norm and output, on EMU0) blocks 0-2: two mapped ranges
    assert [b.name for b in mapped.buffers] == ["CPU_Mapped", "CPU_Mapped", "EMU0"]
    assert mapped.moved is not None and mapped.moved.from_buffer_type == "EMU_Host"


def test_unsupported_op_falls_back_and_is_counted(tmp_path: Path) -> None:
    path = block_model(tmp_path / "m.gguf", 3, per_block=EXPERTS)
    p = make_plan(path, "EMU0=1GiB:unsupported=MUL_MAT_ID", n_gpu_layers=99, load_mode="none", no_host=True)
    where = {t.name: t.buffer_type for t in p.tensors}
    assert where["blk.0.ffn_up_exps.weight"] == "CPU"  # MUL_MAT_ID refused: next in the list
    assert where["blk.0.ffn_up_exps.bias"] == "EMU0"  # a bias is an ADD
    assert where["blk.0.attn_q.weight"] == "EMU0"
    assert p.moved is not None
    assert p.moved.count == 3 and p.moved.first_tensor == "blk.0.ffn_up_exps.weight"
    assert p.moved.line().startswith("tensor 'blk.0.ffn_up_exps.weight' (F32) (and 2 others) cannot be used")


def test_row_split_needs_split_buffers(tmp_path: Path) -> None:
    with pytest.raises(PlacementError, match="device EMU0 does not support split buffers"):
        make_plan(block_model(tmp_path / "m.gguf", 2), "EMU0=1GiB", split_mode="row")


def test_tied_output(tmp_path: Path) -> None:
    path = block_model(tmp_path / "m.gguf", 4, output=False)
    on_device = make_plan(path, "EMU0=1GiB", n_gpu_layers=99)
    copies = [t for t in on_device.tensors if t.name == "token_embd.weight"]
    assert [(t.buffer_type, t.role) for t in copies] == [("CPU", "weight"), ("EMU0", "tied_output")]
    emu0 = next(b for b in on_device.buffers if b.name == "EMU0")
    assert emu0.nbytes == 4 * 2 * 128 + 128 + 4 * 32 * 4  # blocks, output_norm, token_embd copy
    on_cpu = make_plan(path, "EMU0=1GiB", n_gpu_layers=0)
    assert [t.role for t in on_cpu.tensors if t.name == "token_embd.weight"] == ["weight"]


def test_mapped_ranges_are_own_minus_others(tmp_path: Path) -> None:
    path = block_model(tmp_path / "m.gguf", 4, per_block=("attn_q.weight", "ffn_up.weight", "ffn_down.weight"))
    p = make_plan(path, "EMU0=1GiB", n_gpu_layers=99, override_tensor=["ffn_=CPU"])
    mapped = [b for b in p.buffers if b.mapped]
    # token_embd, then one range per block's two ffn tensors (attn_q of each block is on EMU0)
    assert len(mapped) == 1 + 4
    assert all(b.nbytes == 2 * 128 for b in mapped[1:])
    for b in mapped:
        for i in b.tensors:
            t = p.tensors[i]
            assert b.file_range is not None and b.file_range[0] <= t.offset < t.offset + t.nbytes <= b.file_range[1]


def test_each_mapped_tensor_is_held_by_the_range_it_lies_in(tmp_path: Path) -> None:
    """Checked one tensor at a time: a tensor of a context that wraps the file belongs to
    exactly the mapped buffer of its context and file whose range it lies in."""
    path = block_model(tmp_path / "m.gguf", 4, output=False, per_block=("attn_q.weight", "ffn_up.weight"))
    p = make_plan(path, "EMU0=1GiB", n_gpu_layers=3, override_tensor=["ffn_=CPU"])
    mapped = [b for b in p.buffers if b.mapped]
    assert {b.buffer_type for b in mapped} == {"CPU"} and len(mapped) > 1
    wrapped = {(b.lazy, b.buffer_type) for b in mapped}
    expected: dict[int, list[int]] = {k: [] for k in range(len(p.buffers))}
    for i in sorted(range(len(p.tensors)), key=lambda i: p.tensors[i].offset):
        t = p.tensors[i]
        if (t.lazy, t.buffer_type) not in wrapped:
            continue
        homes = [
            k
            for k, b in enumerate(p.buffers)
            if b.mapped and (b.lazy, b.buffer_type) == (t.lazy, t.buffer_type) and b.file_index == t.file_index
            and b.file_range is not None and b.file_range[0] <= t.offset and t.offset + t.nbytes <= b.file_range[1]
        ]  # fmt: skip
        assert len(homes) == 1, t.name
        expected[homes[0]].append(i)
    assert {k: list(b.tensors) for k, b in enumerate(p.buffers) if b.mapped} == {
        k: v for k, v in expected.items() if p.buffers[k].mapped
    }


def test_plan_is_deterministic(tmp_path: Path) -> None:
    path = block_model(tmp_path / "m.gguf", 6)
    devs = devices("EMU0=1GiB,EMU1=2GiB")
    params = make_params([d.default_buffer_type.name for d in devs], n_gpu_layers=5)
    memory = MemorySnapshot.take(devs)  # the host's free memory changes; the snapshot does not
    a = plan(open_model(path), devs, params, memory=memory)
    b = plan(open_model(path), devs, params, memory=memory)
    assert a.to_dict() == b.to_dict()


# -- P04: plan against load, budgets, allocation failure ------------------------------------


@pytest.mark.parametrize("mode", ["mmap", "none"])
def test_p04_load_allocates_what_the_plan_says(tmp_path: Path, mode: str) -> None:
    path = block_model(tmp_path / "m.gguf", 8, output=False)
    devs = devices("EMU0=1GiB,EMU1=1GiB")
    params = make_params([d.default_buffer_type.name for d in devs], n_gpu_layers=6, load_mode=mode, no_host=True)
    p = plan(open_model(path), devs, params, memory=MemorySnapshot.take(devs))
    with asyncio.run(load_model(open_model(path), devices=devs, params=params)) as model:
        for use in p.device_use:
            if use.device.startswith("EMU"):
                emu = next(d for d in devs if d.name == use.device)
                assert isinstance(emu, EMUDevice) and emu.allocated == use.allocated
        assert [(b.buffer_type, b.nbytes) for b in model.report.buffers] == [(b.name, b.nbytes) for b in p.buffers]
    assert all(d.allocated == 0 for d in devs if isinstance(d, EMUDevice))


def test_p04_a_load_that_does_not_fit_fails_before_allocating(tmp_path: Path) -> None:
    path = block_model(tmp_path / "m.gguf", 8, elements=1024)
    devs = devices("EMU0=20KiB,EMU1=1GiB")
    params = make_params([d.default_buffer_type.name for d in devs], n_gpu_layers=99, tensor_split="3,1")
    p = plan(open_model(path), devs, params, memory=MemorySnapshot.take(devs))
    assert not p.fits and not next(u for u in p.device_use if u.device == "EMU0").fits
    with pytest.raises(BudgetExceededError, match="EMU0 needs .* MiB, 0.02 MiB free"):
        asyncio.run(load_model(open_model(path), devices=devs, params=params))
    assert all(d.allocated == 0 for d in devs if isinstance(d, EMUDevice))


def test_p04_allocation_failure_mid_load_frees_everything(tmp_path: Path) -> None:
    path = block_model(tmp_path / "m.gguf", 8, elements=1024)
    devs = devices("EMU0=1MiB,EMU1=1MiB")
    params = make_params([d.default_buffer_type.name for d in devs], n_gpu_layers=99)
    index = open_model(path)
    p = plan(index, devs, params, memory=MemorySnapshot.take(devs))
    assert p.fits
    emu1 = devs[2]
    assert isinstance(emu1, EMUDevice)
    squatter = emu1.alloc(emu1.default_buffer_type, emu1.total - 1024)  # memory taken after planning
    with pytest.raises(OutOfMemoryError, match="EMU1: out of memory"):
        asyncio.run(load_plan(index, p, devs))
    assert devs[1].allocated == 0  # type: ignore[attr-defined]
    assert emu1.allocated == emu1.total - 1024
    squatter.free()


# -- P05: largest allocation ----------------------------------------------------------------


def test_p05_buffers_split_at_the_largest_allocation(tmp_path: Path) -> None:
    path = block_model(tmp_path / "m.gguf", 8, elements=1024)  # 4 KiB tensors
    devs = devices("EMU0=1GiB:max_alloc=10KiB")
    params = make_params([d.default_buffer_type.name for d in devs], n_gpu_layers=99, load_mode="none", no_host=True)
    p = plan(open_model(path), devs, params, memory=MemorySnapshot.take(devs))
    emu = next(b for b in p.buffers if b.name == "EMU0")
    assert len(emu.chunks) > 1 and all(c <= 10 * 1024 for c in emu.chunks)
    assert sum(emu.chunks) == emu.nbytes
    assert p.buffer_lines()[-1] == f"        EMU0 model buffer size = {emu.nbytes / MiB:8.2f} MiB"
    raw = path.read_bytes()
    index = open_model(path)
    with asyncio.run(load_model(index, devices=devs, params=params)) as model:
        emu0 = devs[1]
        assert isinstance(emu0, EMUDevice) and emu0.allocated == emu.nbytes
        on_emu = [t for t in model.tensors.values() if t.device == "EMU0"]
        assert len(on_emu) == 8 * 2 + 2
        for t in on_emu:
            w = index[t.name]
            assert t.data.tobytes() == raw[w.offset : w.end]
    devs = devices("EMU0=1GiB:max_alloc=1KiB")
    with pytest.raises(PlacementError, match="too large to fit in a EMU0 buffer"):
        plan(open_model(path), devs, params, memory=MemorySnapshot.take(devs))


def test_tensor_data_larger_than_the_host_is_refused_before_allocating(tmp_path: Path) -> None:
    import struct

    from gguf import GGUFValueType as V

    from tests.helpers import gguf_kv, gguf_tensor_info, raw_gguf

    i8 = 24
    huge = 1 << 40  # 1 TiB of I8 data in a sparse file
    header = raw_gguf(
        [gguf_kv("general.architecture", V.STRING, struct.pack("<Q", 5) + b"llama")],
        [gguf_tensor_info("w", [huge], i8, 0)],
    )
    path = tmp_path / "sparse.gguf"
    with open(path, "wb") as f:
        f.write(header)
        f.truncate(len(header) + huge)
    with pytest.raises(BudgetExceededError, match="CPU needs .* MiB"):
        asyncio.run(load_model(open_model(path), load_mode="none"))
    p = plan(
        open_model(path), [CPUDevice()], make_params([], load_mode="mmap"), memory=MemorySnapshot.take([CPUDevice()])
    )
    assert p.fits  # mapped, not allocated


# -- hostile flags ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "phrase"),
    [
        ("(a|aa)+$=CPU", "takes too long to match"),
        ("a{4294967296}=CPU", "invalid pattern"),
        ("(" * 1000 + "a" + ")" * 1000 + "=CPU", "characters long"),
        ("([=CPU", "invalid pattern"),
    ],
)
def test_override_patterns_that_would_hang_or_crash(tmp_path: Path, override: str, phrase: str) -> None:
    path = tmp_path / "m.gguf"
    from tests.helpers import write_fixture

    f32 = gguf_f32()
    write_fixture(path, tensors={"blk.0." + "a" * 40 + ".weight": (np.ones(4, dtype=np.float32), f32)})
    started = time.perf_counter()
    with pytest.raises(PlacementError, match=phrase):
        make_plan(path, "EMU0=1GiB", override_tensor=[override])
    assert time.perf_counter() - started < 5


def gguf_f32():  # type: ignore[no-untyped-def]
    import gguf

    return gguf.GGMLQuantizationType.F32


@pytest.mark.parametrize("split", ["1e39,1", "nan,1", "-1,1", "inf"])
def test_tensor_split_values_must_be_finite_proportions(tmp_path: Path, split: str) -> None:
    from service.errors import RequestError

    with pytest.raises(RequestError, match="invalid tensor_split value"):
        make_plan(block_model(tmp_path / "m.gguf", 2), "EMU0=1GiB,EMU1=1GiB", tensor_split=split)


@pytest.mark.parametrize(
    ("spec", "phrase"),
    [
        ("EMU0=0.5", "less than one byte"),
        ("EMU\u0663=1GiB", "invalid emulated device"),
        ("EMU0=1GiB:bandwidth=0", "must be positive"),
        ("EMU0=1GiB:sync:sync", "given twice"),
        ("EMU0=1e400GiB", "invalid size"),
        ("EMU0=99999999999999999999GiB", "too large"),
        ("EMU0=", "invalid size"),
    ],
)
def test_malformed_emulated_devices(spec: str, phrase: str) -> None:
    from service.errors import RequestError

    with pytest.raises(RequestError, match=phrase):
        devices(spec)


def test_split_mode_none_uses_the_kept_devices_host_buffer(tmp_path: Path) -> None:
    p = make_plan(
        block_model(tmp_path / "m.gguf", 4), "EMU0=1GiB,EMU1=1GiB", split_mode="none", main_gpu=1, n_gpu_layers=2,
        load_mode="none",
    )  # fmt: skip
    host = next(b for b in p.buffers if b.name == "EMU_Host")
    assert host.device == "EMU1" and host.memory == "CPU"


def test_mmap_mlock_counts_locked_mappings_against_host_memory(tmp_path: Path) -> None:
    import struct

    from gguf import GGUFValueType as V

    from tests.helpers import gguf_kv, gguf_tensor_info, raw_gguf

    huge = 1 << 40
    kv = [gguf_kv("general.architecture", V.STRING, struct.pack("<Q", 5) + b"llama")]
    header = raw_gguf(kv, [gguf_tensor_info("w", [huge], 24, 0)])
    path = tmp_path / "sparse.gguf"
    with open(path, "wb") as f:
        f.write(header)
        f.truncate(len(header) + huge)
    assert plan(
        open_model(path), [CPUDevice()], make_params([], load_mode="mmap"), memory=MemorySnapshot.take([CPUDevice()])
    ).fits
    locked = plan(
        open_model(path),
        [CPUDevice()],
        make_params([], load_mode="mmap+mlock"),
        memory=MemorySnapshot.take([CPUDevice()]),
    )
    assert not locked.fits
    with pytest.raises(BudgetExceededError):
        asyncio.run(load_model(open_model(path), load_mode="mmap+mlock"))


def test_staging_buffers_count_against_host_memory(tmp_path: Path) -> None:
    from service.loader.pipeline import LoadOptions

    path = block_model(tmp_path / "m.gguf", 2)
    devs = devices("EMU0=1GiB")
    params = make_params(["CPU", "EMU0"], load_mode="none", n_gpu_layers="all")
    options = LoadOptions(staging_buffers=64, staging_nbytes=1 << 30)  # 64 GiB of staging
    with pytest.raises(BudgetExceededError, match="staging buffers included"):
        asyncio.run(load_model(open_model(path), devices=devs, params=params, options=options))
    assert devs[1].allocated == 0  # type: ignore[attr-defined]


def test_cgroup_v1_limits_are_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from service.loader.devices import cpu

    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text(f"{150 << 20}\n")
    (tmp_path / "memory" / "memory.usage_in_bytes").write_text(f"{50 << 20}\n")
    monkeypatch.setattr(cpu, "_CGROUP", tmp_path)
    mem = cpu.host_memory()
    assert mem.total == 150 << 20 and mem.free <= 100 << 20
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert cpu.host_memory().total > 150 << 20


def test_a_limit_on_the_services_own_cgroup_counts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from service.loader.devices import cpu

    # cgroup v2 without a namespace: the service's cgroup is a path below the root
    service = tmp_path / "system.slice" / "hoist.service"
    service.mkdir(parents=True)
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text(f"{8 << 30}\n")
    (tmp_path / "system.slice" / "memory.max").write_text(f"{4 << 30}\n")
    (tmp_path / "system.slice" / "memory.current").write_text(f"{1 << 30}\n")
    (service / "memory.max").write_text(f"{300 << 20}\n")
    (service / "memory.current").write_text(f"{100 << 20}\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/system.slice/hoist.service\n")
    monkeypatch.setattr(cpu, "_CGROUP", tmp_path)
    monkeypatch.setattr(cpu, "_PROC_CGROUP", proc)
    mem = cpu.host_memory()
    assert mem.total == 300 << 20 and mem.free <= 200 << 20
    # the parent's limit is tighter once it is nearly full
    (tmp_path / "system.slice" / "memory.current").write_text(f"{(4 << 30) - (50 << 20)}\n")
    assert cpu.host_memory().free <= 50 << 20
