"""bench/peers.py: the synthetic model it writes, the page-cache helpers, its summary math,
and (where a llama.cpp build is at hand) its llama.cpp program."""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import gguf
import numpy as np
import pytest

from service.loader.weights import open_model
from tests.llama_src import ROOT, llama_cpp_dir

MiB = 1 << 20


def _load_peers() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_peers", ROOT / "bench" / "peers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


peers = _load_peers()


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    shape = peers.synthetic_shape(3 * MiB, n_embd=128, n_vocab=300)
    return peers.write_synthetic(tmp_path_factory.mktemp("peers") / shape.file_name, shape)


def test_the_synthetic_model_is_a_llama_model_gguf_py_reads_with_every_required_tensor(small_model: Path) -> None:
    shape = peers.synthetic_shape(3 * MiB, n_embd=128, n_vocab=300)
    reader = gguf.GGUFReader(small_model)
    names = {t.name for t in reader.tensors}
    per_block = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
    expected = {"token_embd.weight", "output_norm.weight", "output.weight"}
    expected |= {f"blk.{i}.{t}.weight" for i in range(shape.n_layer) for t in per_block}
    assert names == expected
    assert len(reader.tensors) == 3 + 9 * shape.n_layer
    data_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    assert data_bytes >= 3 * MiB
    assert data_bytes == shape.tensor_nbytes()
    # one block fewer would not reach the size asked for
    assert peers.SyntheticShape(shape.n_embd, shape.n_ff, shape.n_layer - 1, shape.n_vocab).tensor_nbytes() < 3 * MiB

    field = reader.get_field("general.architecture")
    assert field is not None and field.contents() == "llama"
    assert reader.get_field("llama.block_count").contents() == shape.n_layer
    assert reader.get_field("llama.embedding_length").contents() == 128
    tokens = reader.get_field("tokenizer.ggml.tokens").contents()
    assert len(tokens) == 300 and tokens[:3] == ["<unk>", "<s>", "</s>"] and tokens[3 + 0x0A] == "<0x0A>"
    assert reader.get_field("tokenizer.ggml.model").contents() == "llama"

    by_name = {t.name: t for t in reader.tensors}
    embd = by_name["token_embd.weight"]
    assert [int(d) for d in embd.shape] == [128, 300]  # ggml order: n_embd, n_vocab
    assert [int(d) for d in by_name["blk.0.attn_k.weight"].shape] == [128, shape.n_head_kv * 64]
    assert [int(d) for d in by_name["blk.0.ffn_down.weight"].shape] == [shape.n_ff, 128]
    for t in reader.tensors:
        values = np.asarray(t.data, dtype=np.float32)
        assert np.isfinite(values).all(), t.name
    assert np.asarray(by_name["blk.0.ffn_up.weight"].data, dtype=np.float32).std() > 0.001


def test_hoist_reads_the_synthetic_model_as_gguf_py_does(small_model: Path) -> None:
    index = open_model(small_model)
    reader = gguf.GGUFReader(small_model)
    assert len(index) == len(reader.tensors)
    assert index.nbytes == sum(int(t.n_bytes) for t in reader.tensors)


def test_synthetic_shape_refuses_what_llama_cpp_could_not_load() -> None:
    with pytest.raises(ValueError, match="multiple of 64"):
        peers.synthetic_shape(MiB, n_embd=100)
    with pytest.raises(ValueError, match="byte tokens"):
        peers.synthetic_shape(MiB, n_vocab=258)


def test_a_synthetic_model_already_written_is_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shape = peers.synthetic_shape(MiB)
    (tmp_path / shape.file_name).write_bytes(b"kept")

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("written again")

    monkeypatch.setattr(peers, "write_synthetic", refuse)
    assert peers.synthetic_model(tmp_path, MiB).read_bytes() == b"kept"


def test_eviction_leaves_the_file_out_of_the_page_cache_as_mincore_sees_it(tmp_path: Path) -> None:
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(4 * MiB))
    peers.warm(path)
    assert peers.resident_fraction(path) == 1.0
    assert peers.evict(path, "fadvise") == "fadvise"
    assert peers.resident_fraction(path) < 0.05
    peers.warm(path)
    assert peers.resident_fraction(path) == 1.0


def _records() -> list[dict[str, Any]]:
    out = []
    for side, mode, loads, tensors in (
        ("hoist", "none", [3.0, 1.0, 2.0], [0.5, 0.4, 0.9]),
        ("llama", "none", [4.0, 8.0, 6.0], [1.0, 0.2, 0.6]),
        ("hoist", "direct-io", [1.0, 1.0, 4.0], [0.3, 0.1, 0.2]),
        ("read", "buffered", [0.25, 0.25, 0.5], [0.25, 0.25, 0.5]),
        ("read", "direct", [0.4, 0.2, 0.8], [0.4, 0.2, 0.8]),
    ):
        for load_s, tensors_s in zip(loads, tensors, strict=True):
            rec = {"model": "m", "cache": "warm", "side": side, "mode": mode, "load_s": load_s}
            out.append(rec | {"tensors_s": tensors_s, "tensor_bytes": 10**9})
    out.append(
        {"model": "m", "cache": "cold", "side": "hoist", "mode": "none", "load_s": 9.0, "tensors_s": 5.0}
        | {"tensor_bytes": 10**9}
    )
    # a run that failed counts nowhere
    out.append({"model": "m", "cache": "warm", "side": "llama", "mode": "none", "error": "exited 1"})
    return out


def test_the_summary_gives_medians_ranges_ratios_and_throughput() -> None:
    rows = peers.summarize(_records())
    assert [(r.model, r.cache, r.mode) for r in rows] == [
        ("m", "warm", "none"),
        ("m", "warm", "direct-io"),
        ("m", "cold", "none"),
    ]
    none, direct, cold = rows
    assert none.hoist_load == peers.Spread(2.0, 1.0, 3.0, 3)
    assert none.llama_load == peers.Spread(6.0, 4.0, 8.0, 3)
    assert none.ratio_load == pytest.approx(statistics.median([3.0, 1.0, 2.0]) / statistics.median([4.0, 8.0, 6.0]))
    assert none.ratio_tensors == pytest.approx(0.5 / 0.6)
    assert none.gbps(none.hoist_tensors) == pytest.approx(2.0)  # 1e9 bytes in 0.5 s
    # buffered modes against the buffered read, direct-io against the O_DIRECT read
    assert none.vs_read == pytest.approx(0.5 / 0.25)
    assert direct.vs_read == pytest.approx(0.2 / 0.4)
    # no llama.cpp runs, no baseline of that cache state: no ratio rather than a wrong one
    assert direct.llama_load is None and direct.ratio_load is None and direct.ratio_tensors is None
    assert cold.read is None and cold.vs_read is None and cold.hoist_load.median == 9.0


def test_the_tables_show_every_row_with_its_numbers() -> None:
    rows = peers.summarize(_records())
    md = peers.markdown_table(rows)
    assert len(md) == 2 + len(rows)
    assert all(line.count("|") == md[0].count("|") for line in md)
    cells = [c.strip() for c in md[2].strip("|").split("|")]
    assert cells[:3] == ["m", "warm", "none"]
    assert cells[3] == "2000 (1000-3000)" and cells[4] == "6000 (4000-8000)" and cells[5] == "0.33"
    assert cells[-1] == "2.00"
    text = peers.text_table(rows)
    assert len(text) == 2 + len(rows) and "0.33" in text[2] and text[3].split()[2] == "direct-io"


def test_the_filesystem_of_a_path_is_its_longest_mount() -> None:
    described = peers.filesystem_of(ROOT)
    assert " at /" in described and not described.startswith("?")


def _llama_lib_dir() -> Path | None:
    named = os.environ.get("HOIST_LLAMA_LIB_DIR")
    for path in [Path(named)] if named else [ROOT.parent / "llama-build" / "bin"]:
        if (path / "libllama.so").is_file():
            return path
    return None


@pytest.mark.parametrize("mode", ["none", "mmap", "mlock", "mmap+mlock", "direct-io"])
def test_llama_cpp_loads_the_synthetic_model_through_our_program(
    small_model: Path, tmp_path_factory: pytest.TempPathFactory, mode: str
) -> None:
    tree, lib_dir = llama_cpp_dir(), _llama_lib_dir()
    if tree is None or lib_dir is None:
        pytest.skip("no llama.cpp source tree and build: set HOIST_LLAMA_CPP_DIR and HOIST_LLAMA_LIB_DIR")
    build = peers.find_llama(lib_dir, tree, tmp_path_factory.getbasetemp())
    program = peers.compile_program(build, tmp_path_factory.getbasetemp() / "bin")
    done = subprocess.run([str(program), str(small_model), mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stderr == ""  # llama.cpp's log is silenced
    out = json.loads(done.stdout)
    # llama.cpp counts the same tensor bytes as gguf-py, and reports progress once per tensor and at 1.0
    reader = gguf.GGUFReader(small_model)
    assert out["model_size"] == sum(int(t.n_bytes) for t in reader.tensors)
    assert out["progress_calls"] == len(reader.tensors) + 1
    assert out["progress_last"] == 1.0
    assert 0 < out["tensors_s"] <= out["load_s"]


def test_our_llama_cpp_program_refuses_an_unknown_mode(tmp_path_factory: pytest.TempPathFactory) -> None:
    tree, lib_dir = llama_cpp_dir(), _llama_lib_dir()
    if tree is None or lib_dir is None:
        pytest.skip("no llama.cpp source tree and build: set HOIST_LLAMA_CPP_DIR and HOIST_LLAMA_LIB_DIR")
    program = peers.compile_program(
        peers.find_llama(lib_dir, tree, tmp_path_factory.getbasetemp()), tmp_path_factory.getbasetemp() / "bin"
    )
    done = subprocess.run([str(program), "x.gguf", "fast"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "usage" in done.stderr


def test_a_saved_run_is_summarized_again_as_markdown(tmp_path: Path) -> None:
    runs = [r | {"rep": 0, "evict": "fadvise", "resident_before": 0.0} for r in _records()]
    info = {
        "date": "2026-01-01 00:00 UTC",
        "cpu": "cpu",
        "cores": 2,
        "ram_gib": 1.0,
        "kernel": "k",
        "filesystem": "ext4",
        "transparent_hugepage": "madvise",
        "hoist_commit": "abc",
        "python": "3.11",
    }
    saved = tmp_path / "runs.json"
    saved.write_text(json.dumps({"machine": info, "llama": "a build", "runs": runs}))
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "peers.py"), "--summarize", str(saved), "--markdown"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    assert out[0] == "date: 2026-01-01 00:00 UTC"
    assert any(line.startswith("cold: evicted with fadvise") for line in out)
    assert any("1 runs failed" in line for line in out)
    table = [line for line in out if line.startswith("| m |")]
    assert table == peers.markdown_table(peers.summarize(runs))[2:]


def test_only_configurations_fast_on_both_sides_get_more_rounds_alternating_who_goes_first(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # mmap loads take 5 ms on both sides, none takes 5 ms for hoist but 200 ms for llama.cpp
    seconds = {("hoist", "mmap"): 0.005, ("llama", "mmap"): 0.005, ("hoist", "none"): 0.005, ("llama", "none"): 0.2}
    calls: list[tuple[str, str]] = []

    def fake_child(cmd: list[str]) -> dict[str, Any]:
        side = "llama" if cmd[0] == "llama_load" else cmd[3]
        calls.append((side, cmd[-1]))
        s = seconds.get((side, cmd[-1]), 0.5)
        return {"load_s": s, "tensors_s": s, "tensor_bytes": 1}

    monkeypatch.setattr(peers, "run_child", fake_child)
    records = peers.bench_model(
        small_model, "m", Path("llama_load"), modes=["none", "mmap"], caches=["warm"], repeat=3,
        evict_method="fadvise", log=lambda line: None, fast_samples=7,
    )  # fmt: skip
    per_config = {
        (side, mode): sum(1 for r in records if (r["side"], r["mode"]) == (side, mode)) for side, mode in seconds
    }
    assert per_config == {("hoist", "mmap"): 7, ("llama", "mmap"): 7, ("hoist", "none"): 3, ("llama", "none"): 3}
    # rounds 3 to 6 go on alternating: llama.cpp first in odd rounds
    assert calls[-8:] == [("llama", "mmap"), ("hoist", "mmap"), ("hoist", "mmap"), ("llama", "mmap")] * 2
    assert sorted(r["rep"] for r in records if (r["side"], r["mode"]) == ("hoist", "mmap")) == list(range(7))
    header = peers.header_lines({"date": "d", "cpu": "c", "cores": 2, "ram_gib": 1, "kernel": "k",
                                 "filesystem": "f", "transparent_hugepage": "t", "hoist_commit": "h",
                                 "python": "3"}, "o", records, 3)  # fmt: skip
    assert "(7 for the configurations whose first 3 ran under 100 ms: m warm mmap)" in header[3]
    # 0 turns the extra rounds off
    calls.clear()
    peers.bench_model(
        small_model, "m", Path("llama_load"), modes=["mmap"], caches=["warm"], repeat=2,
        evict_method="fadvise", log=lambda line: None, fast_samples=0,
    )  # fmt: skip
    assert len(calls) == 2 * (2 + 2)
