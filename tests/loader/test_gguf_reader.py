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


def assert_kv_like_gguf_py(path: Path, theirs: gguf.GGUFReader) -> None:
    """Every KV pair of ``path`` as hoist reads it has the key, order, value type and value
    gguf-py's reader ``theirs`` gives."""
    ours = read_gguf(path)
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
    assert keys == list(ours.kv)
    for key in keys:
        field = theirs.fields[key]
        entry = ours.kv[key]
        assert entry.type == field.types[0], key
        value = entry.value
        if isinstance(value, GGUFArray):
            assert value.element_type == field.types[-1], key
        if isinstance(value, GGUFArray):
            if value.element_type == V.STRING:
                assert value.string_bytes() == [bytes(field.parts[i]) for i in field.data]
            else:
                expected = np.concatenate([field.parts[i] for i in field.data]) if field.data else np.array([])
                np.testing.assert_array_equal(value.numpy(), expected.astype(value.numpy().dtype))
        else:
            assert field.contents() == pytest.approx(value) if isinstance(value, float) else field.contents() == value


def test_metadata_agrees_with_gguf_py(all_types_fixture: Fixture) -> None:
    assert_kv_like_gguf_py(all_types_fixture.path, gguf.GGUFReader(all_types_fixture.path))


def assert_tensor_infos_like_gguf_py(path: Path, theirs: gguf.GGUFReader, alignment: int) -> None:
    """Every tensor info of ``path`` as hoist reads it, in file order, has the name, shape,
    ggml type, size and data offset gguf-py's reader ``theirs`` gives."""
    ours = read_gguf(path)
    assert ours.alignment == alignment
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.ne == tuple(int(d) for d in ref.shape)
        assert mine.ggml_type.id == int(ref.tensor_type)
        assert mine.nbytes == int(ref.n_bytes)
        assert ours.data_offset + mine.offset == int(ref.data_offset)
        assert (ours.data_offset + mine.offset) % alignment == 0


@pytest.mark.parametrize("fixture_name", ["all_types_fixture", "aligned_fixture"])
def test_tensor_infos_agree_with_gguf_py(fixture_name: str, request: pytest.FixtureRequest) -> None:
    fx: Fixture = request.getfixturevalue(fixture_name)
    assert_tensor_infos_like_gguf_py(fx.path, gguf.GGUFReader(fx.path), fx.alignment)


@pytest.mark.sample
def test_sample_header_agrees_with_gguf_py(sample_path: Path, sample_reader: gguf.GGUFReader) -> None:
    """Each bundled model: every KV value and every tensor info as gguf-py reads them."""
    assert_kv_like_gguf_py(sample_path, sample_reader)
    field = sample_reader.fields.get("general.alignment")
    assert_tensor_infos_like_gguf_py(sample_path, sample_reader, int(field.contents()) if field else 32)


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
    with pytest.raises(TruncatedError, match="cannot fit in a file of 30 bytes") as info:
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


# -- hand-made hostile inputs -------------------------------------------------------------

from tests.helpers import gguf_kv, gguf_string, gguf_tensor_info, raw_gguf  # noqa: E402

F32 = 0


def _f32_info(name: str | bytes = "t", ne: list[int] | None = None, offset: int = 0) -> bytes:
    return gguf_tensor_info(name, ne or [8], F32, offset)


def test_invalid_utf8_key_is_refused(tmp_path: Path) -> None:
    p = _write(tmp_path, raw_gguf([gguf_kv(b"bad\xff", V.UINT8, b"\x01")], []))
    with pytest.raises(MetadataError, match="not valid UTF-8") as info:
        read_gguf(p)
    assert info.value.offset == 24


def test_invalid_utf8_string_values_are_replaced_and_kept(tmp_path: Path) -> None:
    arr = struct.pack("<IQ", V.STRING, 2) + gguf_string(b"ok") + gguf_string(b"\xc3(")
    p = _write(tmp_path, raw_gguf([gguf_kv("s", V.STRING, gguf_string(b"a\xffb")), gguf_kv("a", V.ARRAY, arr)], []))
    f = read_gguf(p)
    assert f.get("s") == "a\ufffdb"
    assert f.get("a").strings() == ["ok", "\ufffd("]
    assert f.get("a").string_bytes() == [b"ok", b"\xc3("]


def test_invalid_utf8_tensor_name_is_refused(tmp_path: Path) -> None:
    p = _write(tmp_path, raw_gguf([], [_f32_info(b"t\xfe")], b"\0" * 32))
    with pytest.raises(TensorInfoError, match="not valid UTF-8"):
        read_gguf(p)


def test_empty_arrays_and_strings(tmp_path: Path) -> None:
    kvs = [
        gguf_kv("e", V.ARRAY, struct.pack("<IQ", V.INT32, 0)),
        gguf_kv("es", V.ARRAY, struct.pack("<IQ", V.STRING, 0)),
        gguf_kv("s", V.STRING, gguf_string("")),
    ]
    f = read_gguf(_write(tmp_path, raw_gguf(kvs, [])))
    assert f.get("e").to_list() == [] and f.get("es").to_list() == [] and f.get("s") == ""
    assert f.tensors == [] and f.data_offset == len(raw_gguf(kvs, []))


@pytest.mark.parametrize(
    ("info", "error", "phrase"),
    [
        (_f32_info(b"a\0b"), TensorInfoError, "contains a NUL byte"),
        (_f32_info("x" * 64), TensorInfoError, "64 bytes long, at most 63"),
        (_f32_info("t", [8, -1]), TensorInfoError, "dimension 1 is -1"),
        (_f32_info("t", [2**62, 2**62]), TensorInfoError, "element count overflows"),
        (gguf_tensor_info("t", [8], 4, 0), TensorInfoError, r"ggml type 4 \(Q4_2\), which ggml no longer"),
        (gguf_tensor_info("t", [32], 31, 0), TensorInfoError, r"ggml type 31 \(Q4_0_4_4\), which ggml no longer"),
        (gguf_tensor_info("t", [32], 43, 0), TensorInfoError, "unknown ggml type 43"),
        (gguf_tensor_info("t", [8], -1, 0), TensorInfoError, "unknown ggml type -1"),
        (_f32_info("t", [8], 32), TensorInfoError, "offset 32, expected 0"),
        (gguf_tensor_info("t", [], 2, 0), TensorInfoError, r"ne\[0\] = 1, not a multiple of the Q4_0 block size 32"),
    ],
)
def test_bad_tensor_infos(tmp_path: Path, info: bytes, error: type, phrase: str) -> None:
    p = _write(tmp_path, raw_gguf([], [info], b"\0" * 64))
    with pytest.raises(error, match=phrase):
        read_gguf(p)


def test_max_name_length_is_accepted(tmp_path: Path) -> None:
    p = _write(tmp_path, raw_gguf([], [_f32_info("x" * 63)], b"\0" * 32))
    assert read_gguf(p).tensors[0].name == "x" * 63


def test_huge_counts_are_refused_before_parsing(tmp_path: Path) -> None:
    data = bytearray(raw_gguf([gguf_kv("k", V.UINT8, b"\x01")], []))
    struct.pack_into("<Q", data, 16, 2**63)
    with pytest.raises(TruncatedError, match="declares 9223372036854775808 KV pairs"):
        read_gguf(_write(tmp_path, bytes(data)))
    data = bytearray(raw_gguf([], [_f32_info()], b"\0" * 32))
    struct.pack_into("<Q", data, 8, 2**64 - 1)
    with pytest.raises(TruncatedError, match="tensor infos"):
        read_gguf(_write(tmp_path, bytes(data)))


@pytest.mark.parametrize(
    ("payload", "phrase"),
    [
        (struct.pack("<IQ", V.INT64, 2**29), "declares 536870912 INT64 elements"),
        (struct.pack("<IQ", V.STRING, 2**29), "declares 536870912 strings"),
        (struct.pack("<IQ", V.INT64, 2**61), "more than the limit"),
        (struct.pack("<IQ", V.UINT8, 2**31), "more than the limit"),
        (struct.pack("<IQ", 99, 1) + b"\0", "invalid value type 99"),
        (struct.pack("<IQ", V.STRING, 2) + gguf_string("a") + struct.pack("<Q", 2**50), "string 1 of key 'k'"),
    ],
    ids=["int64-count", "string-count", "over-limit", "u8-over-limit", "bad-element-type", "string-length"],
)
def test_bad_arrays(tmp_path: Path, payload: bytes, phrase: str) -> None:
    with pytest.raises(FormatError, match=phrase):
        read_gguf(_write(tmp_path, raw_gguf([gguf_kv("k", V.ARRAY, payload)], [])))


def test_not_a_regular_file(tmp_path: Path) -> None:
    from service.errors import StorageError

    with pytest.raises(StorageError, match="not a regular file"):
        read_gguf(tmp_path)
    with pytest.raises(StorageError, match="No such file"):
        read_gguf(tmp_path / "missing.gguf")


def test_zero_element_tensor_with_huge_dimensions(tmp_path: Path) -> None:
    p = _write(tmp_path, raw_gguf([], [_f32_info("t0", [8, 0, 2**62, 2**62])], b"\0" * 32))
    with pytest.raises(TensorInfoError, match="overflows 63 bits") as info:
        read_gguf(p)
    assert info.value.tensor == "t0"
    p = _write(tmp_path, raw_gguf([], [_f32_info("t0", [2**61, 0])], b"\0" * 32))
    with pytest.raises(TensorInfoError, match="overflows 63 bits"):
        read_gguf(p)


def test_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    import os

    from service.errors import StorageError

    fifo = tmp_path / "f.gguf"
    os.mkfifo(fifo)
    with pytest.raises(StorageError, match="not a regular file"):
        read_gguf(fifo)


def test_file_shrinking_while_parsed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from service.loader.gguf import reader

    arr = struct.pack("<IQ", V.STRING, 3) + gguf_string("a") + gguf_string("b") + gguf_string("c")
    p = _write(tmp_path, raw_gguf([gguf_kv("k", V.ARRAY, arr)], []))
    real_pread = os.pread

    real_preadv = os.preadv

    def shrinking_pread(fd: int, n: int, offset: int) -> bytes:
        return real_pread(fd, min(n, 30), offset) if offset < 30 else b""

    def shrinking_preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        return real_preadv(fd, [buffers[0][:30]], offset) if offset < 30 else 0

    monkeypatch.setattr(reader.os, "pread", shrinking_pread)
    monkeypatch.setattr(reader.os, "preadv", shrinking_preadv)
    monkeypatch.setattr(reader, "_FIRST_READ", 8)
    with pytest.raises(TruncatedError, match="did it shrink"):
        read_gguf(p)
