"""Load speed and memory: every load mode, onto the host and onto an emulated device,
against a plain sequential read of the same file measured in the same run.

    .venv/bin/python bench/load.py [PATH ...] [--repeat N] [--modes none,mmap,...]

PATH defaults to every bundled real model (placed in ./models as ``hoist sample`` does),
one after the other. Every measurement runs
in a fresh process, so that each one starts with no memory of its own and its peak RSS
is its own; the header is parsed before the clock starts (``bench/parse.py`` measures
that). The baselines read the file's tensor data into a fresh buffer of that size,
with the same calls the loader makes: ``preadv`` of 16 MiB chunks (buffered), and
``O_DIRECT`` reads of 64 MiB chunks (for ``direct-io``). The page cache is warm for
buffered reads and mmap (run once first); direct reads bypass it.

Prints, per configuration: the median time, GB/s of tensor data, the ratio to its
baseline (baseline time / load time: 1.0 is as fast as a plain read; for the emulated
device the baseline reads into one reused 16 MiB (direct: 64 MiB) staging buffer and
copies each chunk into the destination, what a staged upload does), and the RSS the load
added at its peak against tensor bytes + staging pool + 64 MiB.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# this directory holds bench/service.py, which would shadow the ``service`` package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

MiB = 1 << 20
CHUNK = 16 * MiB
DIRECT_CHUNK = 64 * MiB


def _rss() -> int:
    """Current resident set size in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _data_range(path: str) -> tuple[int, int, int]:
    from service.loader.weights import open_model

    index = open_model(path)
    first = min(w.offset for w in index.weights.values())
    last = max(w.end for w in index.weights.values())
    return first, last, index.nbytes


def _setup(kind: str, mode: str) -> tuple[list[Any], Any]:
    """The devices and placement flags of a load onto the host (``host``) or onto an
    emulated GPU (``emu``): every layer offloaded, no host buffer types."""
    from service.loader.devices import discover_devices
    from service.loader.placement import make_params

    devices = discover_devices("EMU0=64GiB" if kind == "emu" else "", cuda=False)
    names = [d.default_buffer_type.name for d in devices]
    return devices, make_params(names, load_mode=mode, n_gpu_layers="all", no_host=True)


def _emu_runs(index: Any) -> list[tuple[int, int]]:
    """(file offset, bytes) of what a ``none`` load onto the emulated device moves, in
    load order, contiguous neighbours merged (not sorted: a tied output is moved twice)."""
    from service.loader.placement import MemorySnapshot, plan

    devices, params = _setup("emu", "none")
    placement = plan(index, devices, params, memory=MemorySnapshot.take(devices))
    out: list[tuple[int, int]] = []
    for t in placement.tensors:
        if out and out[-1][0] + out[-1][1] == t.offset:
            out[-1] = (out[-1][0], out[-1][1] + t.nbytes)
        elif t.nbytes:
            out.append((t.offset, t.nbytes))
    return out


def child(kind: str, path: str, mode: str) -> dict[str, Any]:
    """One measurement, in this (fresh) process; the header is parsed before timing."""
    from service.io.align import align_down, align_up, aligned_empty
    from service.loader.pipeline import LoadOptions, load_model
    from service.loader.weights import open_model

    first, last, tensor_bytes = _data_range(path)
    index = open_model(path)
    runs = _emu_runs(index) if mode.endswith("+copy") else []
    before = _rss()
    start = time.perf_counter()
    staging = 0
    if kind == "baseline" and mode.endswith("+copy"):
        # what a staged upload cannot beat: the bytes the emulated-device load moves
        # (``runs``: a tied output is moved twice), each chunk read into one reused
        # staging buffer and then copied into the destination
        buf = aligned_empty(sum(n for _, n in runs) + 4096)
        direct = mode.startswith("direct")
        step = DIRECT_CHUNK if direct else CHUNK
        bounce = aligned_empty(step + 4096)
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        at = 0
        for lo, n in runs:
            pos, end = (align_down(lo, 4096), align_up(lo + n, 4096)) if direct else (lo, lo + n)
            while pos < end:
                got = os.preadv(fd, [bounce[: min(step, end - pos)].data], pos)
                if got <= 0:
                    break
                a, b = max(pos, lo), min(pos + got, lo + n)
                buf[at + a - lo : at + b - lo] = bounce[a - pos : b - pos]
                pos += got
            at += n
        os.close(fd)
    elif kind == "baseline":
        buf = aligned_empty(last - first + 2 * 4096)
        if mode == "direct":
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            pos = align_down(first, 4096)
            end = align_up(last, 4096)
            while pos < end:
                n = min(DIRECT_CHUNK, end - pos)
                got = os.preadv(fd, [buf[pos - align_down(first, 4096) :][:n].data], pos)
                if got <= 0:
                    break
                pos += got
        else:
            fd = os.open(path, os.O_RDONLY)
            pos = first
            while pos < last:
                n = min(CHUNK, last - pos)
                pos += os.preadv(fd, [buf[pos - first :][:n].data], pos)
        os.close(fd)
    else:
        devices, params = _setup(kind, mode)
        options = LoadOptions()
        model = asyncio.run(load_model(index, devices=devices, params=params, options=options))
        staging = sum(p.buffers for p in model.stats.pools.values()) * options.staging_size(
            4096 if mode == "direct-io" else 1
        )
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "seconds": seconds,
        "tensor_bytes": tensor_bytes,
        "rss_before": before,
        "rss_peak": peak,
        "staging_bytes": staging,
    }


def measure(kind: str, path: str, mode: str, repeat: int) -> list[dict[str, Any]]:
    runs = []
    for _ in range(repeat):
        out = subprocess.run(
            [sys.executable, __file__, "--child", kind, path, mode],
            capture_output=True,
            text=True,
            check=True,
        )
        runs.append(json.loads(out.stdout))
    return runs


def default_paths() -> list[Path]:
    """Every bundled real model, placed in ./models."""
    from service.sample import place_samples

    return place_samples(Path("models"))


def bench_file(path: str, repeat: int, modes: list[str]) -> list[str]:
    """Every configuration on ``path``, ``repeat`` rounds; returns the report's lines."""
    measure("baseline", path, "buffered", 1)  # warm the page cache

    def median(runs: list[dict[str, Any]], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    # one run of every configuration per round, so that the machine's drift and noise
    # fall on all of them alike
    configs = [
        ("baseline", "buffered"),
        ("baseline", "direct"),
        ("baseline", "buffered+copy"),
        ("baseline", "direct+copy"),
    ]
    configs += [(kind, mode) for mode in modes for kind in ("host", "emu")]
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {c: [] for c in configs}
    for _ in range(repeat):
        for kind, mode in configs:
            runs[(kind, mode)].extend(measure(kind, path, mode, 1))
    tensor_bytes = runs[configs[0]][0]["tensor_bytes"]
    lines = [f"file: {path} ({tensor_bytes / MiB:.2f} MiB of tensor data), median of {repeat} runs each"]
    for name in ("buffered", "direct", "buffered+copy", "direct+copy"):
        t = median(runs[("baseline", name)], "seconds")
        lines.append(f"baseline {name:<13} read       {t * 1000:8.1f} ms  {tensor_bytes / t / 1e9:6.2f} GB/s")
    header = f"{'mode':<11} {'target':<5} {'time':>10} {'GB/s':>7} {'ratio':>6}   {'RSS added':>10} {'bound':>10}"
    lines.append(header)
    for kind, mode in configs[4:]:
        # onto the host: against a plain read; onto a device: against read + copy
        name = ("direct" if mode == "direct-io" else "buffered") + ("+copy" if kind == "emu" else "")
        base = median(runs[("baseline", name)], "seconds")
        t = median(runs[(kind, mode)], "seconds")
        added = statistics.median(r["rss_peak"] - r["rss_before"] for r in runs[(kind, mode)])
        bound = tensor_bytes + runs[(kind, mode)][0]["staging_bytes"] + 64 * MiB
        verdict = "" if kind == "emu" else ("  ok" if added <= bound else "  OVER")
        lines.append(
            f"{mode:<11} {kind:<5} {t * 1000:8.1f}ms {tensor_bytes / t / 1e9:7.2f} {base / t:6.2f}   "
            f"{added / MiB:8.1f}Mi {bound / MiB:8.1f}Mi{verdict}"
        )
    return lines


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.stdout.write(json.dumps(child(sys.argv[2], sys.argv[3], sys.argv[4])))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="*", type=Path, metavar="PATH")
    parser.add_argument("--repeat", type=int, default=5, help="runs per configuration (default 5)")
    parser.add_argument("--modes", default="none,mmap,mlock,mmap+mlock,direct-io")
    args = parser.parse_args()
    for path in args.paths or default_paths():
        sys.stdout.write("\n".join(bench_file(str(path), args.repeat, args.modes.split(","))) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
