"""The GGUF reader returns exactly what was written, and agrees with gguf-py's reader."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGUFValueType as V

from service.errors import (
    FormatError,
    MetadataError,
    NotGGUFError,
    TensorBoundsError,
    TensorInfoError,
    TruncatedError,
    UnsupportedVersionError,
)
from service.loader.gguf import GGUFArray, read_gguf
from service.loader.weights import layer_of, open_model
from tests.helpers import Fixture, mixed_tensors, write_fixture


def _same(expected: object, got: object, vtype: V) -> bool:
    if vtype in (V.FLOAT32, V.FLOAT64):
        assert isinstance(expected, float) and isinstance(got, float)
        return math.isclose(expected, got, rel_tol=1e-6 if vtype == V.FLOAT32 else 0)
    return expected == got


def test_every_value_type_reads_back_as_written(all_types_fixture: Fixture) -> None:
    f = read_gguf(all_types_fixture.path)
    assert f.version == 3 and f.byte_order == "little"
    assert f.get("general.architecture") == "llama"
    for key, value, vtype, sub in all_types_fixture.kv:
        entry = f.kv[key]
        if vtype == V.ARRAY:
            assert isinstance(entry.value, GGUFArray)
            assert entry.value.element_type == sub
            assert len(entry.value) == len(value)
            got = entry.value.to_list()
            assert sub is not None
            assert all(_same(a, b, sub) for a, b in zip(value, got, strict=True)), key
            assert entry.type_name == f"ARRAY[{sub.name}]"
        else:
            assert entry.type == vtype
            assert _same(value, entry.value, vtype), key


def test_metadata_agrees_with_gguf_py(all_types_fixture: Fixture) -> None:
    ours = read_gguf(all_types_fixture.path)
    theirs = gguf.GGUFReader(all_types_fixture.path)
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
    assert keys == list(ours.kv)
    for key in keys:
        field = theirs.fields[key]
        value = ours.kv[key].value
        if isinstance(value, GGUFArray):
            if value.element_type == V.STRING:
                assert value.string_bytes() == [bytes(field.parts[i]) for i in field.data]
            else:
                expected = np.concatenate([field.parts[i] for i in field.data]) if field.data else np.array([])
                np.testing.assert_array_equal(value.numpy(), expected.astype(value.numpy().dtype))
        else:
            assert field.contents() == pytest.approx(value) if isinstance(value, float) else field.contents() == value


@pytest.mark.parametrize("fixture_name", ["all_types_fixture", "aligned_fixture"])
def test_tensor_infos_agree_with_gguf_py(fixture_name: str, request: pytest.FixtureRequest) -> None:
    fx: Fixture = request.getfixturevalue(fixture_name)
    ours = read_gguf(fx.path)
    theirs = gguf.GGUFReader(fx.path)
    assert ours.alignment == fx.alignment
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.ne == tuple(int(d) for d in ref.shape)
        assert mine.ggml_type.id == int(ref.tensor_type)
        assert mine.nbytes == int(ref.n_bytes)
        assert ours.data_offset + mine.offset == int(ref.data_offset)
        assert (ours.data_offset + mine.offset) % fx.alignment == 0


def test_alignment_other_than_default(aligned_fixture: Fixture) -> None:
    f = read_gguf(aligned_fixture.path)
    assert f.alignment == 64
    assert f.data_offset % 64 == 0
    assert all(t.offset % 64 == 0 for t in f.tensors)


def test_weights_map_is_in_layer_order(all_types_fixture: Fixture) -> None:
    index = open_model(all_types_fixture.path)
    names = list(index.weights)
    assert names == [
        "output_norm.weight",
        "token_embd.weight",
        "blk.0.ffn_down.weight",
        "blk.1.pos.weight",
        "blk.2.attn_norm.weight",
        "blk.2.ffn_up.weight",
        "blk.10.attn_q.weight",
    ]
    f = index.files[0]
    for name, w in index.weights.items():
        assert w.file_index == 0
        assert w.offset == f.data_offset + f.tensor(name).offset
        assert w.nbytes == f.tensor(name).nbytes
    assert index.nbytes == sum(data.nbytes for data, _ in all_types_fixture.tensors.values())


@pytest.mark.parametrize(
    ("name", "layer"),
    [("blk.0.attn_q.weight", 0), ("blk.17.x", 17), ("token_embd.weight", -1), ("blk.x.y", -1), ("blk.3", -1)],
)
def test_layer_number(name: str, layer: int) -> None:
    assert layer_of(name) == layer


# -- bad inputs ---------------------------------------------------------------------------


def _base(tmp_path: Path) -> bytes:
    rng = np.random.default_rng(3)
    tensors = {"t0": (rng.standard_normal(8).astype(np.float32), gguf.GGMLQuantizationType.F32)}
    fx = write_fixture(tmp_path / "base.gguf", tensors=tensors)
    return fx.path.read_bytes()


def _write(tmp_path: Path, data: bytes, name: str = "bad.gguf") -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def test_wrong_magic_is_named(tmp_path: Path) -> None:
    data = _base(tmp_path)
    p = _write(tmp_path, b"GGML" + data[4:])
    with pytest.raises(NotGGUFError) as info:
        read_gguf(p)
    assert str(p) in str(info.value) and "'GGML'" in str(info.value) and "expected 'GGUF'" in str(info.value)


def test_truncated_header(tmp_path: Path) -> None:
    data = _base(tmp_path)
    # cut inside the first KV pair: the declared counts no longer fit
    p = _write(tmp_path, data[:30])
    with pytest.raises(TruncatedError, match="cannot fit") as info:
        read_gguf(p)
    assert info.value.path == str(p)
    # cut inside the tensor info of t0, after its name
    t0 = read_gguf(_write(tmp_path, data, "whole.gguf")).tensor("t0")
    cut = t0.info_offset + 8 + 2 + 4 + 3
    with pytest.raises(TruncatedError, match="dimension 0 of tensor 't0'") as info:
        read_gguf(_write(tmp_path, data[:cut], "cut.gguf"))
    assert info.value.offset == cut - 3


def test_tensor_data_past_end_of_file(tmp_path: Path) -> None:
    data = _base(tmp_path)
    p = _write(tmp_path, data[:-1])
    read_gguf(p)  # the header is intact
    with pytest.raises(TensorBoundsError) as info:
        open_model(p)
    msg = str(info.value)
    assert "'t0'" in msg and "past the end of the file" in msg and f"({len(data) - 1} bytes)" in msg


def test_version_errors(tmp_path: Path) -> None:
    data = bytearray(_base(tmp_path))
    struct.pack_into("<I", data, 4, 1)
    with pytest.raises(UnsupportedVersionError, match="version 1 is no longer supported"):
        read_gguf(_write(tmp_path, bytes(data)))
    struct.pack_into("<I", data, 4, 4)
    with pytest.raises(UnsupportedVersionError, match="unknown GGUF version 4"):
        read_gguf(_write(tmp_path, bytes(data)))


def test_duplicate_key_and_bad_alignment(tmp_path: Path) -> None:
    with pytest.raises(FormatError):
        # gguf-py refuses to write duplicates, so patch a second key's name over the first
        fx = write_fixture(tmp_path / "d.gguf", kv=[("general.aaaaaaaaaaaa", 1, V.UINT32, None)])
        raw = fx.path.read_bytes().replace(b"general.aaaaaaaaaaaa", b"general.architecture")
        read_gguf(_write(tmp_path, raw))
    fx = write_fixture(tmp_path / "a.gguf", kv=[("general.alignment", 48, V.UINT32, None)])
    with pytest.raises(MetadataError, match="non-zero power of two"):
        read_gguf(fx.path)


def test_tensor_info_errors_name_the_tensor(tmp_path: Path) -> None:
    fx = write_fixture(tmp_path / "t.gguf", tensors=mixed_tensors(2))
    raw = bytearray(fx.path.read_bytes())
    f = read_gguf(fx.path)
    info = f.tensor("blk.10.attn_q.weight")
    n_dims_at = info.info_offset + 8 + len(info.name)
    struct.pack_into("<I", raw, n_dims_at, 5)
    with pytest.raises(TensorInfoError) as exc:
        read_gguf(_write(tmp_path, bytes(raw)))
    assert exc.value.tensor == "blk.10.attn_q.weight" and "n_dims 5" in str(exc.value)
    assert exc.value.offset == n_dims_at
