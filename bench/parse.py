"""Parse speed: gguf-py's ``GGUFReader(path)`` against hoist's parse (header, KV metadata,
tensor infos and the weights index) of the same file, in the same run.

    python bench/parse.py [PATH] [--repeat N] [--ref-repeat M]

PATH defaults to the sample model (placed with ``hoist sample``). Prints both medians and
the ratio reference / hoist.
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


def default_path() -> Path:
    from service.sample import place_sample

    return place_sample(Path("models"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", nargs="?", type=Path)
    parser.add_argument("--repeat", type=int, default=20, help="runs of hoist's parse (default 20)")
    parser.add_argument("--ref-repeat", type=int, default=3, help="runs of GGUFReader (default 3)")
    args = parser.parse_args()
    path = args.path or default_path()

    open_model(path)  # warm the page cache; both sides then read from memory
    ours = median_seconds(lambda: open_model(path), args.repeat)
    ref = median_seconds(lambda: gguf.GGUFReader(path), args.ref_repeat)
    index = open_model(path)
    lines = [
        f"file: {path} ({path.stat().st_size} bytes, {len(index)} tensors, {len(index.metadata.kv)} KV pairs)",
        f"gguf.GGUFReader   median of {args.ref_repeat}: {ref * 1000:10.1f} ms",
        f"hoist open_model  median of {args.repeat}: {ours * 1000:10.1f} ms",
        f"ratio (GGUFReader / hoist): {ref / ours:.0f}x",
    ]
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
