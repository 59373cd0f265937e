"""Parse speed: hoist's header parse (``read_gguf``; and with the weights index,
``open_model``) against llama.cpp's ``gguf_init_from_file`` (``no_alloc``, so the header
only) and gguf-py's ``GGUFReader(path)``, of the same file, in the same run.

    python bench/parse.py [PATH ...] [--repeat N] [--ref-repeat M] [--llama-lib-dir DIR]
                          [--fresh N]

PATH defaults to every bundled real model (placed in ./models as ``hoist sample`` does).
llama.cpp's side is called through ctypes from ``libggml-base.so`` in ``--llama-lib-dir``
(default ``$LLAMA_LIB_DIR``); without it, or when the library is not there, that side is
skipped and the script says so. Runs are interleaved (hoist, llama.cpp, hoist, ...).
Prints, per file, the medians and the ratios hoist / llama.cpp (target <= 1) and
gguf-py / hoist.

Like for like: each side's code is loaded before its timer starts (hoist's modules are
imported; llama.cpp's library is loaded), the first call of each is not timed, and the
page cache is warm. This process has numpy loaded (gguf-py imports it), so hoist scans
long string arrays vectorised, as a service does once it has loaded a model.

``--fresh N`` adds N interleaved runs in which each parse is the first of a new process
(hoist's reader imported, llama.cpp's library loaded, then one timed call), as ``hoist
inspect`` parses: numpy is then not loaded, and string arrays shorter than
``_IMPORT_WORTH_STRINGS`` are walked one string at a time instead (importing numpy would
cost more); the line says whether the parse imported it.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# this directory holds bench/service.py, which would shadow the ``service`` package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import gguf  # noqa: E402

from service.loader.gguf import read_gguf  # noqa: E402
from service.loader.weights import open_model  # noqa: E402


class _InitParams(ctypes.Structure):
    """``struct gguf_init_params``: ``bool no_alloc; struct ggml_context ** ctx``."""

    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]


def llama_parser(lib_dir: str | None) -> tuple[Callable[[Path], None] | None, str]:
    """A function running ``gguf_init_from_file`` (``no_alloc``) and ``gguf_free`` on a
    path, from ``libggml-base.so`` in ``lib_dir``; ``None`` and why when there is none."""
    if not lib_dir:
        return None, "llama.cpp: no --llama-lib-dir (or $LLAMA_LIB_DIR); its side is skipped"
    lib_path = Path(lib_dir) / "libggml-base.so"
    try:
        lib = ctypes.CDLL(str(lib_path))
    except OSError as exc:
        return None, f"llama.cpp: cannot load {lib_path} ({exc}); its side is skipped"
    lib.gguf_init_from_file.restype = ctypes.c_void_p
    lib.gguf_init_from_file.argtypes = [ctypes.c_char_p, _InitParams]
    lib.gguf_free.argtypes = [ctypes.c_void_p]
    lib.gguf_free.restype = None

    def parse(path: Path) -> None:
        ctx = lib.gguf_init_from_file(os.fsencode(path), _InitParams(True, None))
        if not ctx:
            raise RuntimeError(f"gguf_init_from_file failed on {path}")
        lib.gguf_free(ctx)

    return parse, f"llama.cpp: gguf_init_from_file from {lib_path}"


def median_seconds(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved(fns: dict[str, Callable[[], Any]], repeat: int) -> dict[str, float]:
    """Median seconds of each function, the functions run in turn ``repeat`` times."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


_FRESH_HOIST = """
import sys, time
sys.path.insert(0, sys.argv[2])
from service.loader.gguf.reader import read_gguf
start = time.perf_counter()
read_gguf(sys.argv[1])
print(time.perf_counter() - start, "numpy" in sys.modules)
"""

_FRESH_LLAMA = """
import ctypes, os, sys, time
class InitParams(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]
lib = ctypes.CDLL(sys.argv[2])
lib.gguf_init_from_file.restype = ctypes.c_void_p
lib.gguf_init_from_file.argtypes = [ctypes.c_char_p, InitParams]
lib.gguf_free.argtypes = [ctypes.c_void_p]
path = os.fsencode(sys.argv[1])
start = time.perf_counter()
ctx = lib.gguf_init_from_file(path, InitParams(True, None))
elapsed = time.perf_counter() - start
if not ctx:
    sys.exit("gguf_init_from_file failed")
lib.gguf_free(ctx)
print(elapsed)
"""


def fresh_lines(path: Path, runs: int, lib_dir: str | None, have_llama: bool) -> list[str]:
    """``runs`` interleaved fresh-process parses of ``path`` by each side; the report's
    lines."""
    root = str(Path(__file__).resolve().parent.parent)
    hoist: list[float] = []
    llama: list[float] = []
    imported = False
    for _ in range(runs):
        out = subprocess.run(
            [sys.executable, "-c", _FRESH_HOIST, str(path), root], check=True, capture_output=True, text=True
        ).stdout.split()
        hoist.append(float(out[0]))
        imported |= out[1] == "True"
        if have_llama and lib_dir:
            lib = str(Path(lib_dir) / "libggml-base.so")
            out = subprocess.run(
                [sys.executable, "-c", _FRESH_LLAMA, str(path), lib], check=True, capture_output=True, text=True
            ).stdout.split()
            llama.append(float(out[0]))
    ours = statistics.median(hoist)
    numpy_note = "numpy imported by the parse" if imported else "numpy not loaded"
    lines = [f"fresh processes: hoist read_gguf median of {runs}: {ours * 1000:8.1f} ms ({numpy_note})"]
    if llama:
        theirs = statistics.median(llama)
        lines += [
            f"fresh processes: llama.cpp     median of {runs}: {theirs * 1000:8.1f} ms",
            f"ratio hoist / llama.cpp, fresh processes: {ours / theirs:.2f}",
        ]
    return lines


def default_paths() -> list[Path]:
    """Every bundled real model, placed in ./models."""
    from service.sample import place_samples

    return place_samples(Path("models"))


def bench_file(
    path: Path, repeat: int, ref_repeat: int, llama: Callable[[Path], None] | None, fresh: int, lib_dir: str | None
) -> list[str]:
    """The parsers on ``path``; returns the report's lines."""
    open_model(path)  # warm the page cache; every side then reads from memory
    fns: dict[str, Callable[[], Any]] = {"read_gguf": lambda: read_gguf(path), "open_model": lambda: open_model(path)}
    if llama is not None:
        llama(path)
        fns["gguf_init_from_file"] = lambda: llama(path)
    med = interleaved(fns, repeat)
    ref = median_seconds(lambda: gguf.GGUFReader(path), ref_repeat)
    index = open_model(path)
    lines = [
        f"file: {path} ({path.stat().st_size} bytes, {len(index)} tensors, {len(index.metadata.kv)} KV pairs)",
        f"hoist read_gguf              median of {repeat}: {med['read_gguf'] * 1000:10.1f} ms",
        f"hoist open_model             median of {repeat}: {med['open_model'] * 1000:10.1f} ms",
    ]
    if llama is not None:
        theirs = med["gguf_init_from_file"]
        lines += [
            f"llama.cpp gguf_init_from_file median of {repeat}: {theirs * 1000:9.1f} ms",
            f"ratio hoist read_gguf / llama.cpp:  {med['read_gguf'] / theirs:.2f} (target <= 1)",
            f"ratio hoist open_model / llama.cpp: {med['open_model'] / theirs:.2f}",
        ]
    lines += [
        f"gguf.GGUFReader              median of {ref_repeat}: {ref * 1000:10.1f} ms",
        f"ratio (GGUFReader / hoist open_model): {ref / med['open_model']:.0f}x",
    ]
    if fresh:
        lines += fresh_lines(path, fresh, lib_dir, llama is not None)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="*", type=Path, metavar="PATH")
    parser.add_argument("--repeat", type=int, default=20, help="runs of hoist's parse (default 20)")
    parser.add_argument("--ref-repeat", type=int, default=3, help="runs of GGUFReader (default 3)")
    parser.add_argument(
        "--llama-lib-dir",
        default=os.environ.get("LLAMA_LIB_DIR"),
        metavar="DIR",
        help="the directory of llama.cpp's libggml-base.so (default: $LLAMA_LIB_DIR)",
    )
    parser.add_argument(
        "--fresh", type=int, default=0, metavar="N", help="also N interleaved runs, each parse in a new process"
    )
    args = parser.parse_args()
    llama, note = llama_parser(args.llama_lib_dir)
    sys.stdout.write(note + "\n")
    for path in args.paths or default_paths():
        lines = bench_file(path, args.repeat, args.ref_repeat, llama, args.fresh, args.llama_lib_dir)
        sys.stdout.write("\n".join(lines) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
