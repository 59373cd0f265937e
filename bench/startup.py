"""Start-up: whole-process wall times of ``hoist --help``, ``hoist inspect`` and ``hoist
serve`` (to the first 200 from ``/healthz``), against baselines measured in the same run.

    python bench/startup.py [PATH] [--repeat N] [--llama-gguf EXE] [--llama-src DIR] [--llama-lib-dir DIR]
                            [--hoist-root DIR] [--no-serve]

PATH defaults to the bundled gemma3 sample (placed in ./models as ``hoist sample`` does).
Every round runs each command once, in the same order (interleaved), as a fresh process
with the file in the page cache and Python's bytecode compiled (as an installed hoist
has it; in a directory of the run's); medians and ranges of ``--repeat`` rounds are printed
with the ratios:

- ``python -c pass``: the interpreter alone, what no command can go below;
- ``hoist --help`` (target: 0.3 s);
- ``hoist inspect PATH`` against llama.cpp's ``llama-gguf PATH r n``, which reads the
  header and the whole file (target: ratio <= 1);
- ``hoist serve`` until ``/healthz`` answers 200 (target: 1 s).

``llama-gguf`` is the program of llama.cpp's ``examples/gguf``: ``--llama-gguf`` names it;
otherwise it is looked for in ``--llama-lib-dir`` (default ``$LLAMA_LIB_DIR``), and when
absent there it is compiled (one C++ file, linked to that directory's ``libggml``) from
``--llama-src`` (default ``$LLAMA_SRC``), llama.cpp's source tree, into a temporary
directory. Without either, the comparison is skipped and the script says so.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# this directory holds bench/service.py, which would shadow the ``service`` package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
HOIST_ROOT = ROOT
"""The hoist checkout whose commands are timed (``--hoist-root``: another revision)."""
HOIST = [sys.executable, "-c", "import sys; from service.cli import main; sys.exit(main())"]


def _say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


PYCACHE: Path | None = None
"""Where the timed interpreters keep compiled bytecode (set in :func:`main`)."""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOIST_")}
    env["PYTHONPATH"] = str(HOIST_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["HOIST_CUDA"] = "0"
    # an installed hoist runs from compiled bytecode (pip and the image compile it):
    # the warm-up round compiles into a directory of this run's, the timed ones load it,
    # whatever PYTHONDONTWRITEBYTECODE says (the checkout is left as it is)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if PYCACHE is not None:
        env["PYTHONPYCACHEPREFIX"] = str(PYCACHE)
    return env


def timed_run(cmd: list[str]) -> float:
    """Seconds from start to exit of ``cmd`` (output discarded); raises if it fails."""
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env(), cwd=HOIST_ROOT)
    return time.perf_counter() - start


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def serve_ready(models_dir: Path) -> float:
    """Seconds from the start of ``hoist serve`` to its first 200 from ``/healthz``."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}/healthz"
    env = _env()
    env["HOIST_MODELS_DIR"] = str(models_dir)
    start = time.perf_counter()
    proc = subprocess.Popen(
        [*HOIST, "serve", "--port", str(port), "--log-level", "warning"],
        env=env,
        cwd=HOIST_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"hoist serve exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == 200:
                        return time.perf_counter() - start
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.perf_counter() - start > 60:
                raise RuntimeError("hoist serve was not ready within 60 s")
            time.sleep(0.005)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def find_llama_gguf(exe: str | None, lib_dir: str | None, src: str | None, build_dir: Path) -> tuple[Path | None, str]:
    """``llama-gguf``: given, found in ``lib_dir``, or compiled from ``src``; with a note
    saying which (or why none)."""
    if exe:
        return Path(exe), f"llama-gguf: {exe}"
    if lib_dir and (Path(lib_dir) / "llama-gguf").is_file():
        return Path(lib_dir) / "llama-gguf", f"llama-gguf: {lib_dir}/llama-gguf"
    if not (lib_dir and src):
        return None, "llama-gguf: not found (give --llama-gguf, or --llama-lib-dir and --llama-src); comparison skipped"
    source = Path(src) / "examples" / "gguf" / "gguf.cpp"
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if not source.is_file() or cxx is None:
        return None, f"llama-gguf: cannot compile ({source} or a C++ compiler missing); comparison skipped"
    out = build_dir / "llama-gguf"
    cmd = [cxx, "-O2", "-std=c++17", f"-I{Path(src) / 'ggml' / 'include'}", str(source)]
    cmd += [f"-L{lib_dir}", "-lggml", "-lggml-base", f"-Wl,-rpath,{lib_dir}", "-pthread", "-o", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        return None, f"llama-gguf: compiling failed, comparison skipped: {result.stderr.strip()[-300:]}"
    return out, f"llama-gguf: compiled from {source} against {lib_dir}"


def default_path() -> Path:
    from service.sample import place_samples

    return place_samples(Path("models"), ["gemma3"])[0]


def _line(name: str, times: list[float]) -> str:
    med = statistics.median(times)
    return f"{name:<28} median {med:6.3f} s  range {min(times):6.3f} - {max(times):6.3f} s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", nargs="?", type=Path, metavar="PATH")
    parser.add_argument("--repeat", type=int, default=7, help="interleaved rounds (default 7)")
    parser.add_argument("--llama-gguf", default=None, metavar="EXE", help="llama.cpp's llama-gguf program")
    parser.add_argument("--llama-lib-dir", default=os.environ.get("LLAMA_LIB_DIR"), metavar="DIR")
    parser.add_argument("--llama-src", default=os.environ.get("LLAMA_SRC"), metavar="DIR")
    parser.add_argument("--no-serve", action="store_true", help="leave out hoist serve")
    parser.add_argument(
        "--hoist-root",
        type=Path,
        default=ROOT,
        metavar="DIR",
        help="time the hoist of this checkout (default: this one)",
    )
    args = parser.parse_args()
    global HOIST_ROOT
    HOIST_ROOT = args.hoist_root.resolve()
    path = (args.path or default_path()).resolve()
    global PYCACHE
    with tempfile.TemporaryDirectory(prefix="hoist-startup-") as tmp:
        PYCACHE = Path(tmp) / "pycache"
        llama, note = find_llama_gguf(args.llama_gguf, args.llama_lib_dir, args.llama_src, Path(tmp))
        _say(f"hoist: {HOIST_ROOT}; file: {path} ({path.stat().st_size} bytes)")
        _say(note)
        models_dir = Path(tmp) / "models"
        models_dir.mkdir()
        runs: dict[str, Callable[[], float]] = {
            "python -c pass": lambda: timed_run([sys.executable, "-c", "pass"]),
            "hoist --help": lambda: timed_run([*HOIST, "--help"]),
            "hoist inspect": lambda: timed_run([*HOIST, "inspect", str(path)]),
        }
        if llama is not None:
            runs["llama-gguf r n"] = lambda: timed_run([str(llama), str(path), "r", "n"])
        if not args.no_serve:
            runs["hoist serve to /healthz"] = lambda: serve_ready(models_dir)
        for fn in runs.values():  # warm the page cache and the interpreter's files
            fn()
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.repeat):
            for name, fn in runs.items():
                times[name].append(fn())
    for name, ts in times.items():
        _say(_line(name, ts))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    _say(f"hoist --help: {med['hoist --help']:.3f} s (target 0.3 s)")
    if "llama-gguf r n" in med:
        _say(f"ratio hoist inspect / llama-gguf: {med['hoist inspect'] / med['llama-gguf r n']:.2f} (target <= 1)")
    if "hoist serve to /healthz" in med:
        _say(f"hoist serve ready: {med['hoist serve to /healthz']:.3f} s (target 1 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
