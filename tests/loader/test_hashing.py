"""Hash-tensors: every tensor's xxh3_64 digest equals that of gguf-py's bytes of it, in every
load mode on the CPU and emulated devices, with one and four reads in flight; nothing
when off; a staging buffer is reused only once it is hashed; cancellation during a
hashed load leaves nothing behind."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gguf
import numpy as np
import pytest
import xxhash
from gguf import GGMLQuantizationType as Q

from service.loader.devices import discover_devices
from service.loader.pipeline import LoadOptions, load_model
from service.loader.placement import make_params
from service.loader.weights import open_model
from tests.loader.test_load_modes import (
    MODES,
    _cancel_at,
    leftovers,
    load,
    load_shrinking_lazy_model,
    valid_tensors,
    write_model,
    write_synthetic,
)
from tests.resources import load_threads

SETUPS = ["cpu", "emu", "emu-sync"]

_EXPECTED: dict[str, dict[str, str]] = {}


def expected_hashes(path: Path) -> dict[str, str]:
    """xxh3_64 of every tensor's bytes as gguf-py's reader gives them."""
    key = str(path)
    if key not in _EXPECTED:
        reader = gguf.GGUFReader(path)
        _EXPECTED[key] = {
            t.name: xxhash.xxh3_64(np.ascontiguousarray(t.data).tobytes()).hexdigest() for t in reader.tensors
        }
    return _EXPECTED[key]


@pytest.fixture
def synthetic(tmp_path: Path) -> Path:
    return write_synthetic(tmp_path / "m.gguf", 21)


@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("setup", SETUPS)
def test_hashes_match_gguf_py(synthetic: Path, setup: str, mode: str, n: int) -> None:
    # small chunks and staging buffers: tensors span several extents and buffers
    model, devs = load(
        synthetic,
        setup,
        mode,
        hash_tensors=True,
        reads_in_flight=n,
        chunk_nbytes=4096,
        direct_chunk_nbytes=8192,
        staging_nbytes=4096,
    )
    with model:
        assert model.tensor_hashes == expected_hashes(synthetic)
        hashed = model.stats.stage_figures()["hash"]
        assert hashed["bytes"] == model.index.nbytes  # every byte hashed once
    assert leftovers(synthetic, devs) == (0, 0, 0, 0)


@pytest.mark.parametrize("mode", ["none", "mmap"])
def test_lazy_and_tied_tensors_are_hashed_once(tmp_path: Path, mode: str) -> None:
    tensors = valid_tensors(22)
    del tensors["output_norm.weight"]
    rng = np.random.default_rng(22)
    tensors["per_layer_token_embd.weight"] = (rng.standard_normal((8, 64)).astype(np.float32), Q.F32)
    tensors["blk.0.empty"] = (np.zeros(0, dtype=np.float32), Q.F32)
    path = write_model(tmp_path / "m.gguf", tensors)
    devs = discover_devices("EMU0=64MiB", cuda=False)
    params = make_params(["CPU", "EMU0"], load_mode=mode, n_gpu_layers="all", lazy_mode="on")
    options = LoadOptions(hash_tensors=True)
    with asyncio.run(load_model(open_model(path), devices=devs, params=params, options=options)) as model:
        assert model["per_layer_token_embd.weight"].lazy
        assert model.tensor_hashes == expected_hashes(path)
        assert model.tensor_hashes["blk.0.empty"] == xxhash.xxh3_64(b"").hexdigest()
        assert model.stats.stage_figures()["hash"]["bytes"] == model.index.nbytes


@pytest.mark.sample
@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("setup", ["cpu", "emu"])
def test_sample_hashes_match_gguf_py(sample_path: Path, setup: str, mode: str, n: int) -> None:
    want = expected_hashes(sample_path)
    model, devs = load(sample_path, setup, mode, hash_tensors=True, reads_in_flight=n)
    with model:
        assert model.tensor_hashes == want
    assert load_threads() == 0 and all(getattr(d, "allocated", 0) == 0 for d in devs)


@pytest.mark.parametrize("mode", ["none", "mmap"])
def test_no_hashes_when_off(synthetic: Path, mode: str) -> None:
    model, _ = load(synthetic, "emu", mode)
    with model:
        assert model.tensor_hashes == {}
        assert "hash" not in model.stats.stage_figures()


def test_a_staging_buffer_is_reused_only_once_hashed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Slow hashing, two small staging buffers and eight reads in flight: a buffer refilled
    before its bytes were hashed would give a wrong digest; the staging bound holds."""
    from service.loader.pipeline import hashing

    class SlowState:
        def __init__(self) -> None:
            self.state = xxhash.xxh3_64()

        def update(self, data: Any) -> None:
            threading.Event().wait(0.002)
            self.state.update(data)

        def hexdigest(self) -> str:
            return self.state.hexdigest()

    monkeypatch.setattr(hashing, "xxhash", SimpleNamespace(xxh3_64=SlowState))
    rng = np.random.default_rng(23)
    path = write_model(tmp_path / "m.gguf", {"blk.0.w": (rng.standard_normal(1 << 16).astype(np.float32), Q.F32)})
    devs = discover_devices("EMU0=64MiB", cuda=False)
    params = make_params(["CPU", "EMU0"], load_mode="none", n_gpu_layers="all")
    options = LoadOptions(staging_buffers=2, staging_nbytes=4096, reads_in_flight=8, hash_tensors=True)
    with asyncio.run(load_model(open_model(path), devices=devs, params=params, options=options)) as model:
        pool = model.stats.pools["EMU0"]
        assert pool.buffers == 2 and pool.peak_in_flight <= 2
        assert pool.waits > 10  # the reader waited for the hashing
        assert model.tensor_hashes == expected_hashes(path)
        assert model.stats.bound() is not None and model.stats.bound()["stage"] == "hash"  # type: ignore[index]


@pytest.mark.parametrize("when", [0, 1, 3, 10])
@pytest.mark.parametrize("mode", ["none", "mmap", "direct-io"])
@pytest.mark.parametrize("setup", ["cpu", "emu"])
def test_cancel_a_hashed_load_at_many_points(tmp_path: Path, setup: str, mode: str, when: int) -> None:
    path = write_model(tmp_path / "m.gguf", valid_tensors(24, big=True))
    _, devs = _cancel_at(
        path, setup, mode, when, chunk_nbytes=512, direct_chunk_nbytes=4096, staging_nbytes=1024, hash_tensors=True
    )
    assert leftovers(path, devs) == (0, 0, 0, 0)


def test_cancel_the_task_during_slow_hashing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from service.loader.pipeline import hashing

    real = hashing.Hashers._feed
    hashing_now = threading.Event()

    def slow_feed(self: hashing.Hashers, job: Any, data: Any) -> None:
        hashing_now.set()
        threading.Event().wait(0.02)
        real(self, job, data)

    monkeypatch.setattr(hashing.Hashers, "_feed", slow_feed)
    path = write_model(tmp_path / "m.gguf", valid_tensors(25, big=True))
    devs = discover_devices("EMU0=64MiB,EMU1=64MiB", cuda=False)
    params = make_params(["CPU", "EMU0", "EMU1"], load_mode="none", n_gpu_layers="all")
    options = LoadOptions(staging_nbytes=2048, hash_tensors=True, check_tensors=True, reads_in_flight=4)

    async def scenario() -> None:
        task = asyncio.create_task(load_model(open_model(path), devices=devs, params=params, options=options))
        while not hashing_now.is_set():
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert leftovers(path, devs) == (0, 0, 0, 0)


def test_a_file_that_shrinks_under_hashing_gives_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lazy (mapped) tensors are hashed through ``pread``: a shrunk file is an error, not
    SIGBUS."""
    load_shrinking_lazy_model(tmp_path, monkeypatch, 26, hash_tensors=True)
