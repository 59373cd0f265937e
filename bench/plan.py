"""Fixed cost of opening and placing a model: ``open_model`` (header parse and weights
index) and ``plan`` (with ``MemorySnapshot.take`` of the CPU device, as a load calls it
under ``-lm mmap``), each timed in fresh processes.

    python bench/plan.py [PATH ...] [--repeat N] [--hoist-root DIR ...]

PATH defaults to every bundled real model (placed in ./models as ``hoist sample`` does).
Each process first imports what bench/peers.py's hoist side imports before its timer
starts (the CPU device, the load pipeline, the placement flags, the weights index), then
times, with the page cache warm:

- ``open 1st`` / ``plan 1st``: the first call of each in the process, what a load in a
  fresh process pays (caches filled on first use included);
- ``open 2nd`` / ``plan 2nd``: the same calls again in that process.

``--hoist-root`` names a hoist checkout to time (default: this one); given more than once,
the checkouts run in turn within every round, so that they are compared under the same
load. Prints medians and the fastest run of ``--repeat`` rounds (default 15), in ms.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# this directory holds bench/service.py, which would shadow the ``service`` package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

_CHILD = """
import json, sys, time
sys.path.insert(0, sys.argv[2])
from service.loader.devices import CPUDevice
from service.loader.pipeline import load_model
from service.loader.placement import LazyMode, LoadMode, MemorySnapshot, PlacementParams, plan
from service.loader.weights import open_model

devices = [CPUDevice()]
params = PlacementParams(load_mode=LoadMode.MMAP, lazy_mode=LazyMode.OFF)
out = {}
for n in ("1st", "2nd"):
    start = time.perf_counter()
    index = open_model(sys.argv[1])
    opened = time.perf_counter()
    plan(index, devices, params, memory=MemorySnapshot.take(devices))
    out["open " + n], out["plan " + n] = opened - start, time.perf_counter() - opened
print(json.dumps(out))
"""

COLUMNS = ("open 1st", "plan 1st", "open 2nd", "plan 2nd")


def child(path: Path, root: Path) -> dict[str, float]:
    """One fresh process's seconds for each of :data:`COLUMNS`."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), str(root)], env=env, cwd=root, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"the timed process failed on {path} with {root}: {done.stderr[-2000:]}")
    out: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def default_paths() -> list[Path]:
    """Every bundled real model, placed in ./models."""
    from service.sample import place_samples

    return place_samples(Path("models"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="*", type=Path, metavar="PATH")
    parser.add_argument("--repeat", type=int, default=15, help="rounds of fresh processes (default 15)")
    parser.add_argument(
        "--hoist-root", type=Path, action="append", metavar="DIR", help="a hoist checkout to time (repeatable)"
    )
    args = parser.parse_args()
    roots = [r.resolve() for r in args.hoist_root or [ROOT]]
    paths = args.paths or default_paths()
    for path in paths:
        child(path, roots[0])  # the page cache holds the file from here on
    runs: dict[tuple[Path, Path], list[dict[str, float]]] = {(p, r): [] for p in paths for r in roots}
    for _ in range(args.repeat):
        for path in paths:
            for root in roots:
                runs[path, root].append(child(path, root))
    for (path, root), rows in runs.items():
        cells = [
            f"{c} {statistics.median(r[c] for r in rows) * 1e3:6.2f} (min {min(r[c] for r in rows) * 1e3:6.2f})"
            for c in COLUMNS
        ]
        sys.stdout.write(f"{path.name}  [{root}]\n  " + "  ".join(cells) + "\n")
    sys.stdout.write(f"ms, median (fastest) of {args.repeat} fresh processes each\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
