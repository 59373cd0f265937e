"""What llama.cpp's gguf.cpp reads, hoist reads the same way: every ggml type of ggml's
table (sizes from ggml's block structs, not gguf-py's), scalar tensors, empty tensor
names, float metadata bit for bit and string values that are not UTF-8; such files load
in the mmap and none load modes."""

from __future__ import annotations

import asyncio
import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGUFValueType as V

from service.errors import TensorInfoError
from service.io.align import align_up
from service.loader.devices import discover_devices
from service.loader.ggml_types import GGML_TYPE_COUNT, GGML_TYPES_BY_NAME, REMOVED_GGML_TYPES
from service.loader.gguf import GGUFArray, GGUFFloat, GGUFString, read_gguf
from service.loader.gguf.constants import SCALAR_FORMATS
from service.loader.model import LoadedModel
from service.loader.pipeline import load_model
from service.loader.placement import make_params
from service.loader.weights import open_model
from tests.helpers import gguf_file, gguf_kv, gguf_string, gguf_tensor_info, raw_gguf, write_fixture
from tests.llama_src import require_llama_cpp
from tests.loader.test_ggml_types import BLOCK_LAYOUTS, PLAIN_TYPES, _script

# (block size, type size) of every ggml type, from ggml's block structs as written out in
# test_ggml_types (checked there against a compiler's sizeof), independent of hoist's table
GGML_SIZES: dict[str, tuple[int, int]] = {
    name: (block, sum(n for _, n in fields)) for name, (block, fields) in BLOCK_LAYOUTS.items()
} | {name: (1, np.dtype(code).itemsize) for name, code in PLAIN_TYPES.items()}


def _write(tmp_path: Path, data: bytes, name: str = "m.gguf") -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def _every_type_tensors(rng: np.random.Generator) -> list[tuple[str | bytes, list[int], int, bytes]]:
    """One tensor per ggml type, two rows of two blocks each, random bytes."""
    out: list[tuple[str | bytes, list[int], int, bytes]] = []
    for name, (block, size) in sorted(GGML_SIZES.items(), key=lambda kv: GGML_TYPES_BY_NAME[kv[0]].id):
        data = rng.integers(0, 256, 2 * 2 * size, dtype=np.uint8).tobytes()
        out.append((f"t.{name}", [2 * block, 2], GGML_TYPES_BY_NAME[name].id, data))
    return out


# -- ggml types -------------------------------------------------------------------------


def test_every_ggml_type_is_read_with_ggml_sizes(tmp_path: Path) -> None:
    tensors = _every_type_tensors(np.random.default_rng(0))
    f = read_gguf(_write(tmp_path, gguf_file(tensors)))
    assert len(f.tensors) == len(tensors) == len(GGML_SIZES)
    expected_offset = 0
    for info, (_, ne, type_id, data) in zip(f.tensors, tensors, strict=True):
        block, size = GGML_SIZES[info.ggml_type.name]
        assert info.ggml_type.id == type_id and info.ne == tuple(ne)
        assert info.nbytes == ne[0] // block * size * ne[1] == len(data)
        assert info.offset == expected_offset
        expected_offset += align_up(len(data), 32)


def test_every_type_of_the_vendored_ggml_is_read(tmp_path: Path) -> None:
    """The type table as read from the llama.cpp tree itself (not hoist's copy)."""
    rows = _script().read_table(require_llama_cpp())[1]
    tensors = [
        (f"t{r.id}", [r.block_size, 3], r.id, bytes(3 * r.type_size)) for r in rows if not r.removed
    ]  # fmt: skip
    f = read_gguf(_write(tmp_path, gguf_file(tensors)))
    assert [(t.ggml_type.id, t.ggml_type.name, t.nbytes) for t in f.tensors] == [
        (r.id, r.name, 3 * r.type_size) for r in rows if not r.removed
    ]
    for r in rows:
        if r.removed:
            p = _write(tmp_path, gguf_file([("t", [32], r.id, bytes(32))]), "removed.gguf")
            with pytest.raises(TensorInfoError, match=f"ggml type {r.id} \\({r.name}\\), which ggml no longer"):
                read_gguf(p)


@pytest.mark.parametrize("type_id", [*sorted(REMOVED_GGML_TYPES), GGML_TYPE_COUNT, -1, 2**31 - 1])
def test_removed_and_unknown_types_are_refused(tmp_path: Path, type_id: int) -> None:
    p = _write(tmp_path, raw_gguf([], [gguf_tensor_info("t", [256], type_id, 0)], bytes(256)))
    with pytest.raises(TensorInfoError, match=f"ggml type {type_id}") as exc:
        read_gguf(p)
    assert exc.value.tensor == "t" and exc.value.offset is not None


def test_q8_1_blocks_are_36_bytes_as_in_ggml(tmp_path: Path) -> None:
    q8_1 = GGML_TYPES_BY_NAME["Q8_1"].id
    # as llama.cpp lays it out: 8 blocks of 36 bytes, the next tensor at 288
    ok = gguf_file([("q", [256], q8_1, bytes(288)), ("f", [8], 0, bytes(32))])
    f = read_gguf(_write(tmp_path, ok))
    assert [(t.nbytes, t.offset) for t in f.tensors] == [(288, 0), (32, 288)]
    # as gguf-py 0.19 writes it, with 40-byte blocks: llama.cpp refuses it, and so does hoist
    blocks = np.zeros((1, 320), np.uint8)
    write_fixture(
        tmp_path / "gguf_py.gguf",
        tensors={"q": (blocks, gguf.GGMLQuantizationType.Q8_1), "f": (np.zeros(8, np.float32), 0)},  # type: ignore[dict-item]
    )
    with pytest.raises(TensorInfoError, match="data offset 320, expected 288") as exc:
        read_gguf(tmp_path / "gguf_py.gguf")
    assert exc.value.tensor == "f"


def test_q2_0_is_known(tmp_path: Path) -> None:
    q2_0 = GGML_TYPES_BY_NAME["Q2_0"]
    assert (q2_0.id, q2_0.block_size, q2_0.type_size) == (42, 64, 18)
    f = read_gguf(_write(tmp_path, gguf_file([("q", [128, 2], 42, bytes(72))])))
    assert f.tensors[0].nbytes == 72
    with pytest.raises(TensorInfoError, match="not a multiple of the Q2_0 block size 64"):
        read_gguf(_write(tmp_path, gguf_file([("q", [32], 42, bytes(9))]), "bad.gguf"))


# -- scalar tensors and empty names ---------------------------------------------------------


def test_scalar_tensors_as_gguf_py_writes_them(tmp_path: Path) -> None:
    write_fixture(
        tmp_path / "s.gguf",
        tensors={"s": (np.array(2.5, np.float32), 0), "v": (np.ones(3, np.float32), 0)},  # type: ignore[dict-item]
    )
    f = read_gguf(tmp_path / "s.gguf")
    s = f.tensor("s")
    assert (s.ne, s.ggml_ne, s.n_elements, s.nbytes) == ((), (1, 1, 1, 1), 1, 4)
    theirs = {t.name: t for t in gguf.GGUFReader(tmp_path / "s.gguf").tensors}
    assert list(theirs["s"].shape) == [] and int(theirs["s"].n_bytes) == s.nbytes
    assert f.tensor("v").offset == 32


def test_scalar_tensors_follow_ggml_dimensions(tmp_path: Path) -> None:
    """ggml counts every undeclared dimension as 1: a scalar of a block type has ne[0] = 1."""
    f = read_gguf(_write(tmp_path, gguf_file([("i", [], 27, struct.pack("<q", -5)), ("h", [], 1, bytes(2))])))
    assert [(t.ne, t.nbytes) for t in f.tensors] == [((), 8), ((), 2)]
    with pytest.raises(TensorInfoError, match=r"ne\[0\] = 1, not a multiple of the Q8_0 block size 32"):
        read_gguf(_write(tmp_path, gguf_file([("q", [], 8, bytes(34))]), "q.gguf"))


def test_empty_tensor_name(tmp_path: Path) -> None:
    f = read_gguf(_write(tmp_path, gguf_file([("", [4], 0, bytes(16)), ("blk.0.attn_q.weight", [4], 0, bytes(16))])))
    assert [t.name for t in f.tensors] == ["", "blk.0.attn_q.weight"]
    assert f.tensor("").nbytes == 16
    index = open_model(f.path)
    assert list(index.weights) == ["", "blk.0.attn_q.weight"]
    with pytest.raises(TensorInfoError, match="duplicate tensor name ''"):
        read_gguf(_write(tmp_path, gguf_file([("", [4], 0, bytes(16)), ("", [4], 0, bytes(16))]), "dup.gguf"))


@pytest.mark.parametrize("name", [b"a\0", b"\0", b"blk.0.x\0y"])
def test_names_with_nul_are_refused(tmp_path: Path, name: bytes) -> None:
    with pytest.raises(TensorInfoError, match="contains a NUL byte"):
        read_gguf(_write(tmp_path, gguf_file([(name, [4], 0, bytes(16))])))


# -- float metadata, bit for bit ------------------------------------------------------------

F32_BITS = [0x7F861E36, 0xFFC00001, 0x7FC00000, 0x7F800000, 0xFF800000, 0x80000000, 0x00000001, 0x3FC00000]
F64_BITS = [0x7FF4000000000001, 0xFFF8000000000123, 0x7FF0000000000000, 0x8000000000000000, 0x1, 0x3FF8000000000000]


def _float_kvs() -> list[bytes]:
    kvs = [gguf_kv(f"f32.{i}", V.FLOAT32, struct.pack("<I", b)) for i, b in enumerate(F32_BITS)]
    kvs += [gguf_kv(f"f64.{i}", V.FLOAT64, struct.pack("<Q", b)) for i, b in enumerate(F64_BITS)]
    kvs.append(gguf_kv("a32", V.ARRAY, struct.pack(f"<IQ{len(F32_BITS)}I", V.FLOAT32, len(F32_BITS), *F32_BITS)))
    kvs.append(gguf_kv("a64", V.ARRAY, struct.pack(f"<IQ{len(F64_BITS)}Q", V.FLOAT64, len(F64_BITS), *F64_BITS)))
    return kvs


def _encode(entry_type: V, value: Any) -> bytes:
    """A KV value encoded again from what the reader gave back."""
    if isinstance(value, GGUFArray):
        return struct.pack("<IQ", value.element_type, value.count) + value.payload
    if isinstance(value, GGUFFloat):
        return value.to_bytes()
    if isinstance(value, GGUFString):
        return gguf_string(value.raw)
    return struct.pack("<" + SCALAR_FORMATS[entry_type][0], value)


def _assert_round_trip(path: Path) -> None:
    f = read_gguf(path)
    raw = path.read_bytes()
    encoded = b"".join(gguf_string(e.key) + struct.pack("<I", e.type) + _encode(e.type, e.value) for e in f.kv.values())
    end = f.tensors[0].info_offset if f.tensors else f.data_offset
    assert encoded == raw[24:end]


def test_float_values_keep_their_bits(tmp_path: Path) -> None:
    p = _write(tmp_path, raw_gguf(_float_kvs(), []))
    f = read_gguf(p)
    for i, bits in enumerate(F32_BITS):
        v = f.get(f"f32.{i}")
        assert isinstance(v, GGUFFloat) and (v.bits, v.width) == (bits, 4)
        assert v.to_bytes() == struct.pack("<I", bits)
    for i, bits in enumerate(F64_BITS):
        v = f.get(f"f64.{i}")
        assert isinstance(v, GGUFFloat) and (v.bits, v.width) == (bits, 8)
    assert f.get("f32.7") == 1.5 and f.get("f64.5") == 1.5
    assert f.get("a32").float_bits().tolist() == F32_BITS
    assert [v.bits for v in f.get("a32").to_list()] == F32_BITS
    assert [v.bits for v in f.get("a64").head(3)] == F64_BITS[:3]
    assert f.get("a32").numpy().view("<u4").tolist() == F32_BITS
    _assert_round_trip(p)
    # gguf-py reads floats through numpy, bit for bit: it agrees
    theirs = gguf.GGUFReader(p)
    assert int(theirs.fields["f32.0"].parts[-1].view(np.uint32)[0]) == F32_BITS[0]


def test_float_values_in_json_are_exact(tmp_path: Path) -> None:
    p = _write(tmp_path, raw_gguf(_float_kvs(), []))
    result = subprocess.run(
        [sys.executable, "-m", "service.cli", "inspect", "--json", str(p)], capture_output=True, text=True, check=True
    )
    values = {m["key"]: m["value"] for m in json.loads(result.stdout)["metadata"]}

    def bits_of(value: Any, width: int) -> int:
        if isinstance(value, str):
            kind, _, hex_bits = value.partition(":0x")
            assert kind in ("nan", "inf", "-inf") and len(hex_bits) == 2 * width
            return int(hex_bits, 16)
        code = "f4" if width == 4 else "f8"
        return int(np.array([value], f"<{code}").view(f"<u{width}")[0])

    assert values["f32.0"] == "nan:0x7f861e36"
    assert values["f32.3"] == "inf:0x7f800000" and values["f64.2"] == "inf:0x7ff0000000000000"
    assert [bits_of(values[f"f32.{i}"], 4) for i in range(len(F32_BITS))] == F32_BITS
    assert [bits_of(values[f"f64.{i}"], 8) for i in range(len(F64_BITS))] == F64_BITS
    assert [bits_of(v, 4) for v in values["a32"]] == F32_BITS
    assert [bits_of(v, 8) for v in values["a64"]] == F64_BITS
    text = subprocess.run(
        [sys.executable, "-m", "service.cli", "inspect", str(p)], capture_output=True, text=True, check=True
    ).stdout
    assert "nan:0x7f861e36" in text and "nan:0xfff8000000000123" in text


# -- strings that are not UTF-8 ---------------------------------------------------------------

BAD = [b"ok", b"\xc3(", b"\xed\xa0\x80", b"\xff"]


def _string_kvs() -> list[bytes]:
    arr = struct.pack("<IQ", V.STRING, len(BAD)) + b"".join(gguf_string(s) for s in BAD)
    return [
        gguf_kv("s.bad", V.STRING, gguf_string(b"a\xffb")),
        gguf_kv("s.good", V.STRING, gguf_string("h\u00e9")),
        gguf_kv("a.str", V.ARRAY, arr),
    ]


def test_invalid_utf8_values_keep_their_bytes(tmp_path: Path) -> None:
    p = _write(tmp_path, raw_gguf(_string_kvs(), []))
    f = read_gguf(p)
    bad = f.get("s.bad")
    assert isinstance(bad, GGUFString) and bad == "a\ufffdb" and bad.raw == b"a\xffb" and not bad.valid_utf8
    good = f.get("s.good")
    assert good == "h\u00e9" and good.raw == "h\u00e9".encode() and good.valid_utf8
    arr = f.get("a.str")
    assert arr.string_bytes() == BAD
    assert arr.strings() == [s.decode("utf-8", "replace") for s in BAD]
    assert [s.raw for s in arr.to_list()] == BAD and [s.raw for s in arr.head(2)] == BAD[:2]
    assert arr.invalid_utf8() == {1: BAD[1], 2: BAD[2], 3: BAD[3]}
    _assert_round_trip(p)


def test_invalid_utf8_values_in_json(tmp_path: Path) -> None:
    p = _write(tmp_path, raw_gguf(_string_kvs(), []))
    result = subprocess.run(
        [sys.executable, "-m", "service.cli", "inspect", "--json", str(p)], capture_output=True, text=True, check=True
    )
    meta = {m["key"]: m for m in json.loads(result.stdout)["metadata"]}
    assert meta["s.bad"]["value"] == "a\ufffdb" and bytes.fromhex(meta["s.bad"]["raw_hex"]) == b"a\xffb"
    assert "raw_hex" not in meta["s.good"]
    assert meta["a.str"]["value"] == [s.decode("utf-8", "replace") for s in BAD]
    assert {int(i): bytes.fromhex(h) for i, h in meta["a.str"]["raw_hex"].items()} == {1: BAD[1], 2: BAD[2], 3: BAD[3]}


# -- loading such files -------------------------------------------------------------------------


def _odd_model(path: Path) -> list[tuple[str | bytes, list[int], int, bytes]]:
    """A model with a tensor of every ggml type, a scalar, an empty name, float metadata with
    odd bits and strings that are not UTF-8."""
    rng = np.random.default_rng(3)
    tensors = _every_type_tensors(rng)
    tensors += [
        ("", [5], 0, rng.standard_normal(5).astype("<f4").tobytes()),
        ("blk.0.scale", [], 0, struct.pack("<f", 2.5)),
        ("blk.0.attn_q.weight", [3, 2], 1, rng.standard_normal(6).astype("<f2").tobytes()),
    ]
    kvs = [gguf_kv("general.architecture", V.STRING, gguf_string("llama"))]
    kvs += [gguf_kv("llama.block_count", V.UINT32, struct.pack("<I", 1)), *_float_kvs(), *_string_kvs()]
    path.write_bytes(gguf_file(tensors, kvs))
    return tensors


def _load(path: Path, mode: str, spec: str = "", **flags: Any) -> LoadedModel:
    devs = discover_devices(spec, cuda=False)
    params = make_params([d.default_buffer_type.name for d in devs], load_mode=mode, **flags)
    return asyncio.run(load_model(open_model(path), devices=devs, params=params))


@pytest.mark.parametrize("mode", ["mmap", "none"])
@pytest.mark.parametrize("setup", ["cpu", "emu"])
def test_odd_files_load(tmp_path: Path, mode: str, setup: str) -> None:
    tensors = _odd_model(tmp_path / "odd.gguf")
    if setup == "emu":
        # the empty name is matched by an override like any other
        model = _load(tmp_path / "odd.gguf", mode, "EMU0=64MiB", n_gpu_layers="all", override_tensor=["^$=CPU"])
    else:
        model = _load(tmp_path / "odd.gguf", mode)
    with model:
        assert len(model) == len(tensors)
        for name, ne, _, data in tensors:
            t = model[name if isinstance(name, str) else name.decode()]
            assert t.ne == tuple(ne) and t.nbytes == len(data)
            assert np.asarray(t.data).tobytes() == data, name
        assert model["blk.0.scale"].data.shape == () and float(model["blk.0.scale"].data) == 2.5
        assert model[""].data.shape == (5,)
        if setup == "emu":
            assert model[""].device == "CPU" and model["blk.0.attn_q.weight"].device == "EMU0"
            assert model["blk.0.scale"].device == "EMU0"
        buffers = {b.buffer_type for b in model.report.buffers}
        assert ("CPU_Mapped" if mode == "mmap" else "CPU") in buffers or setup == "emu"
        assert "EMU0" in buffers or setup == "cpu"


def test_odd_files_in_the_cli(tmp_path: Path) -> None:
    tensors = _odd_model(tmp_path / "odd.gguf")
    result = subprocess.run(
        [sys.executable, "-m", "service.cli", "inspect", "--json", str(tmp_path / "odd.gguf")],
        capture_output=True,
        text=True,
        check=True,
    )
    listed = {t["name"]: t for t in json.loads(result.stdout)["tensors"]}
    assert set(listed) == {n if isinstance(n, str) else n.decode() for n, *_ in tensors}
    assert listed[""]["ne"] == [5] and listed["blk.0.scale"]["ne"] == []
    assert listed["t.Q8_1"]["bytes"] == 4 * 36 and listed["t.Q2_0"]["type"] == "Q2_0"
    for mode in ("mmap", "none"):
        load = subprocess.run(
            [sys.executable, "-m", "service.cli", "load", "--json", "-lm", mode, str(tmp_path / "odd.gguf")],
            capture_output=True,
            text=True,
            check=False,
        )
        assert load.returncode == 0, load.stderr
        assert json.loads(load.stdout)["n_tensors"] == len(tensors)


def test_odd_files_over_http(live_server_emu: str, models_dir: Path) -> None:
    import httpx

    from tests.api.test_loads import wait_for

    _odd_model(models_dir / "odd.gguf")
    flags = {"n_gpu_layers": "all", "override_tensor": ["^$=CPU"], "load_mode": "none"}
    with httpx.Client(base_url=live_server_emu) as client:
        planned = client.post("/v1/plans", json={"model": "odd.gguf", **flags})
        assert planned.status_code == 200, planned.text
        by_name = {t["name"]: t for t in planned.json()["tensors"]}
        # the override moves the empty-named tensor to the CPU list (host buffer type EMU_Host)
        assert by_name[""]["buffer_type"] == "EMU_Host" and by_name["blk.0.attn_q.weight"]["buffer_type"] == "EMU0"
        assert by_name["blk.0.scale"]["bytes"] == 4
        resp = client.post("/v1/loads", json={"model": "odd.gguf", **flags})
        assert resp.status_code == 202, resp.text
        done = wait_for(client, resp.headers["location"], {"succeeded", "failed"})
        assert done["state"] == "succeeded", done
