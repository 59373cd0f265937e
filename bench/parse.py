"""Parse speed: gguf-py's ``GGUFReader(path)`` against hoist's parse (header, KV metadata,
tensor infos and the weights index) of the same file, in the same run.

    python bench/parse.py [PATH ...] [--repeat N] [--ref-repeat M]

PATH defaults to every bundled real model (placed in ./models as ``hoist sample`` does).
Prints, per file, both medians and the ratio reference / hoist.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# this directory holds bench/service.py, which would shadow the ``service`` package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import gguf  # noqa: E402

from service.loader.weights import open_model  # noqa: E402


def median_seconds(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def default_paths() -> list[Path]:
    """Every bundled real model, placed in ./models."""
    from service.sample import place_samples

    return place_samples(Path("models"))


def bench_file(path: Path, repeat: int, ref_repeat: int) -> list[str]:
    """Both parsers on ``path``; returns the report's lines."""
    open_model(path)  # warm the page cache; both sides then read from memory
    ours = median_seconds(lambda: open_model(path), repeat)
    ref = median_seconds(lambda: gguf.GGUFReader(path), ref_repeat)
    index = open_model(path)
    return [
        f"file: {path} ({path.stat().st_size} bytes, {len(index)} tensors, {len(index.metadata.kv)} KV pairs)",
        f"gguf.GGUFReader   median of {ref_repeat}: {ref * 1000:10.1f} ms",
        f"hoist open_model  median of {repeat}: {ours * 1000:10.1f} ms",
        f"ratio (GGUFReader / hoist): {ref / ours:.0f}x",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="*", type=Path, metavar="PATH")
    parser.add_argument("--repeat", type=int, default=20, help="runs of hoist's parse (default 20)")
    parser.add_argument("--ref-repeat", type=int, default=3, help="runs of GGUFReader (default 3)")
    args = parser.parse_args()
    for path in args.paths or default_paths():
        sys.stdout.write("\n".join(bench_file(path, args.repeat, args.ref_repeat)) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
