"""Parse speed: hoist's header parse (``read_gguf``; and with the weights index,
``open_model``) against llama.cpp's ``gguf_init_from_file`` (``no_alloc``, so the header
only) and gguf-py's ``GGUFReader(path)``, of the same file, in the same run.

    python bench/parse.py [PATH ...] [--repeat N] [--ref-repeat M] [--llama-lib-dir DIR]

PATH defaults to every bundled real model (placed in ./models as ``hoist sample`` does).
llama.cpp's side is called through ctypes from ``libggml-base.so`` in ``--llama-lib-dir``
(default ``$LLAMA_LIB_DIR``); without it, or when the library is not there, that side is
skipped and the script says so. Runs are interleaved (hoist, llama.cpp, hoist, ...).
Prints, per file, the medians and the ratios hoist / llama.cpp (target <= 1) and
gguf-py / hoist.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
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


def default_paths() -> list[Path]:
    """Every bundled real model, placed in ./models."""
    from service.sample import place_samples

    return place_samples(Path("models"))


def bench_file(path: Path, repeat: int, ref_repeat: int, llama: Callable[[Path], None] | None) -> list[str]:
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
    args = parser.parse_args()
    llama, note = llama_parser(args.llama_lib_dir)
    sys.stdout.write(note + "\n")
    for path in args.paths or default_paths():
        sys.stdout.write("\n".join(bench_file(path, args.repeat, args.ref_repeat, llama)) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
