"""Inputs reported to break GGUF loaders (tests/data/cases), each with its right outcome:
one typed error whose message names the file, the field and the offset; or a clean load."""

from __future__ import annotations

import asyncio
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from service.errors import (
    ByteOrderError,
    FormatError,
    HoistError,
    MetadataError,
    NotGGUFError,
    SplitError,
    TensorBoundsError,
    TensorInfoError,
    TruncatedError,
    UnsupportedVersionError,
)
from service.loader.gguf import read_gguf
from service.loader.pipeline import load_model
from service.loader.weights import open_model

CASES = Path(__file__).resolve().parent.parent / "data" / "cases"

# file -> (error class, phrases the message must contain, byte offset or None)
ERRORS: dict[str, tuple[type[HoistError], list[str], int | None]] = {
    "empty.gguf": (NotGGUFError, ["too small to be GGUF", "empty"], None),
    "lfs_pointer.gguf": (NotGGUFError, ["not a GGUF file", "Git LFS pointer"], 0),
    "version1.gguf": (UnsupportedVersionError, ["version 1 is no longer supported"], 4),
    "version4.gguf": (UnsupportedVersionError, ["unknown GGUF version 4"], 4),
    "version_bigendian.gguf": (FormatError, ["byte-swapped", "not valid big-endian GGUF either"], 16),
    "truncated_223.gguf": (TensorBoundsError, ["'t1'", "[192, 224)", "past the end of the file (223 bytes)"], 192),
    "truncated_100_in_tinfo.gguf": (TruncatedError, ["unexpected end of file", "tensor 't0'"], 95),
    "keylen_max.gguf": (TruncatedError, ["18446744073709551615", "key of KV pair 0", "exceeds the 192 bytes"], 24),
    "nested_arrays_5000.gguf": (MetadataError, ["nested arrays are not supported"], None),
    "alignment_0.gguf": (MetadataError, ["general.alignment", "non-zero power of two"], None),
    "alignment_48.gguf": (MetadataError, ["general.alignment", "is 48", "non-zero power of two"], None),
    "alignment_int32.gguf": (MetadataError, ["general.alignment", "INT32", "expected UINT32"], None),
    "dup_key.gguf": (MetadataError, ["duplicate key 'general.architecture'"], None),
    "t1_offset_33.gguf": (TensorInfoError, ["'t1'", "offset 33", "not a multiple of the alignment 32"], None),
    "t1_offset_36_misaligned.gguf": (TensorInfoError, ["'t1'", "not a multiple of the alignment 32"], None),
    "t1_offset_36_laid_out.gguf": (TensorInfoError, ["'t1'", "not a multiple of the alignment 32"], None),
    "ndims_5.gguf": (TensorInfoError, ["'t0'", "n_dims 5", "0 to 4"], 79),
    "ndims_ffffffff.gguf": (TensorInfoError, ["'t0'", "n_dims 4294967295"], 79),
    "type_39_or_unknown_1000.gguf": (TensorInfoError, ["'t0'", "unknown ggml type 1000", "newer"], 91),
    "q4k_row_100.gguf": (TensorInfoError, ["'t0'", "ne[0] = 100", "Q4_K block size 256"], None),
    "dup_tensor.gguf": (TensorInfoError, ["duplicate tensor name 't0'"], None),
}


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_case_gives_its_clear_error(name: str) -> None:
    cls, phrases, offset = ERRORS[name]
    path = CASES / name
    with pytest.raises(cls) as info:
        open_model(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ")
    for phrase in phrases:
        assert phrase in message, message
    if offset is not None:
        assert info.value.offset == offset


def test_every_case_file_has_a_test() -> None:
    tested = set(ERRORS) | {"base.gguf", "zero_dim.gguf", "nan.gguf", "bigendian_writer.gguf"}
    assert {p.name for p in CASES.glob("*.gguf")} == tested


def test_base_loads() -> None:
    with asyncio.run(load_model(open_model(CASES / "base.gguf"))) as model:
        np.testing.assert_array_equal(model["t0"].data, np.arange(8, dtype=np.float32))
        np.testing.assert_array_equal(model["t1"].data, np.arange(8, 16, dtype=np.float32))


@pytest.mark.parametrize("mode", ["mmap", "none"])
def test_zero_dim_tensor_loads(mode: str) -> None:
    index = open_model(CASES / "zero_dim.gguf")
    assert index["t0"].info.ne == (8, 0) and index["t0"].nbytes == 0
    with asyncio.run(load_model(index, load_mode=mode)) as model:
        assert model["t0"].data.shape == (0, 8) and model["t0"].nbytes == 0
        np.testing.assert_array_equal(model["t1"].data, np.arange(8, 16, dtype=np.float32))


def test_nan_loads_by_default() -> None:
    with asyncio.run(load_model(open_model(CASES / "nan.gguf"))) as model:
        nans = {name: np.flatnonzero(np.isnan(t.data)).tolist() for name, t in model.tensors.items()}
        assert nans == {"t0": [3], "t1": []}


def test_big_endian_file_is_readable_but_not_loadable() -> None:
    path = CASES / "bigendian_writer.gguf"
    f = read_gguf(path)
    assert f.byte_order == "big" and f.version == 3
    assert f.get("general.architecture") == "llama"
    assert [(t.name, t.ne, t.ggml_type.name) for t in f.tensors] == [("t0", (8,), "F32")]
    with pytest.raises(ByteOrderError, match="gguf-convert-endian"):
        asyncio.run(load_model(open_model(path)))


# -- split3 -------------------------------------------------------------------------------


@pytest.fixture
def split3(tmp_path: Path) -> Path:
    d = tmp_path / "split3"
    shutil.copytree(CASES / "split3", d)
    for p in d.iterdir():
        p.chmod(0o644)
    return d


@pytest.mark.parametrize("mode", ["mmap", "none"])
def test_split_loads_from_the_first_file(split3: Path, mode: str) -> None:
    index = open_model(split3 / "m-00001-of-00003.gguf")
    assert [w.file_index for w in index.weights.values()] == [0, 1, 2]
    with asyncio.run(load_model(index, load_mode=mode)) as model:
        for i, name in enumerate(["t0", "t1", "t2"]):
            np.testing.assert_array_equal(model[name].data, np.full(8, float(i), dtype=np.float32))


def test_split_from_the_second_file_asks_for_the_first(split3: Path) -> None:
    with pytest.raises(SplitError) as info:
        open_model(split3 / "m-00002-of-00003.gguf")
    assert "split 2 of 3" in str(info.value) and "m-00001-of-00003.gguf" in str(info.value)


def test_missing_split_is_named(split3: Path) -> None:
    (split3 / "m-00003-of-00003.gguf").unlink()
    with pytest.raises(SplitError) as info:
        open_model(split3 / "m-00001-of-00003.gguf")
    assert str(split3 / "m-00003-of-00003.gguf") in str(info.value)


def test_tensor_count_mismatch_gives_both_counts(split3: Path) -> None:
    first = split3 / "m-00001-of-00003.gguf"
    f = read_gguf(first)
    entry = f.kv["split.tensors.count"]
    raw = bytearray(first.read_bytes())
    value_at = entry.offset + 8 + len(entry.key) + 4
    assert struct.unpack_from("<i", raw, value_at)[0] == 3
    struct.pack_into("<i", raw, value_at, 4)
    first.write_bytes(bytes(raw))
    with pytest.raises(SplitError) as info:
        open_model(first)
    assert "split.tensors.count is 4" in str(info.value) and "hold 3 tensors" in str(info.value)


# -- the CLI: one line, non-zero exit, no traceback, for every bad case --------------------


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_cli_reports_each_case_cleanly(name: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "service.cli", "load", str(CASES / name)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("hoist: error: ") and name in lines[0]
