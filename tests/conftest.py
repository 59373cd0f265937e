"""Shared fixtures: written GGUF files, the bundled real models, a live service."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import httpx
import pytest

from service.sample import SAMPLES
from tests.helpers import ALL_VALUE_TYPES, Fixture, mixed_tensors, write_fixture

SAMPLE_NAMES = list(SAMPLES)


@pytest.fixture(scope="session")
def sample_file(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``sample_file(name)``: the bundled real model ``name`` (``service.sample.SAMPLES``),
    placed once per session (in ``$HOIST_SAMPLE_CACHE`` when set); skips the test when its
    package is not installed."""
    from service.sample import place_sample, sample_installed

    cache = os.environ.get("HOIST_SAMPLE_CACHE")
    target_dir = Path(cache) if cache else tmp_path_factory.mktemp("sample")
    placed: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in placed:
            if not sample_installed(name):
                pytest.skip(f"the sample extra is not installed (the {name} model)")
            placed[name] = place_sample(target_dir, name)
        return placed[name]

    return get


@pytest.fixture(scope="session", params=SAMPLE_NAMES)
def sample_name(request: pytest.FixtureRequest) -> str:
    """The name of each bundled real model in turn: a test that uses the sample runs on every one."""
    name: str = request.param
    return name


@pytest.fixture(scope="session")
def sample_path(sample_name: str, sample_file: Callable[[str], Path]) -> Path:
    """The file of each bundled real model in turn (see ``sample_name``)."""
    return sample_file(sample_name)


@pytest.fixture(scope="session")
def sample_reader(sample_path: Path):  # type: ignore[no-untyped-def]
    """gguf-py's reader of the sample model (slow: up to 20 s; built once per model)."""
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
    from service.api.server import server_config

    app = create_app(settings)  # type: ignore[arg-type]
    port = _free_port()
    server = uvicorn.Server(server_config(app, settings, host="127.0.0.1", port=port, log_level="warning"))  # type: ignore[arg-type]
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


class ServeProcess:
    """A ``hoist serve`` process on 127.0.0.1 (see :func:`hoist_serve`)."""

    def __init__(self, proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
        self.proc = proc
        self.url = url
        self.log = log

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss(self) -> int:
        """The server's resident memory in bytes."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def cpu_seconds(self) -> float:
        """User + system CPU time the server has used."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture
def hoist_serve(models_dir: Path, tmp_path: Path) -> Iterator[Callable[..., ServeProcess]]:
    """Start ``hoist serve`` processes (``start(**env)``: ``HOIST_*`` settings, extra CLI
    arguments as ``args=[...]``) serving ``models_dir`` on a free local port; they are
    stopped at the end."""
    started: list[ServeProcess] = []

    def start(args: Sequence[str] = (), **settings: str) -> ServeProcess:
        port = _free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("HOIST_")}
        env.update({"HOIST_MODELS_DIR": str(models_dir), "HOIST_CUDA": "0", **settings})
        log = tmp_path / f"serve-{port}.log"
        cmd = [sys.executable, "-c", "import sys; from service.cli import main; sys.exit(main())", "serve"]
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [*cmd, "--port", str(port), "--log-level", "warning", *args],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=Path(__file__).resolve().parent.parent,
            )
        server = ServeProcess(proc, f"http://127.0.0.1:{port}", log)
        started.append(server)
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"hoist serve exited with {proc.returncode}: {server.output()}")
            try:
                if httpx.get(f"{server.url}/healthz", timeout=1).status_code == 200:
                    return server
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"hoist serve did not start: {server.output()}")
            time.sleep(0.05)

    yield start
    for server in started:
        if server.alive:
            server.proc.terminate()
            try:
                server.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.proc.kill()
                server.proc.wait()
