"""Loading onto a CUDA GPU: every load mode with every layer offloaded (``-ngl 99``),
every tensor checked on the device against the file's bytes, upload speed against a plain
pinned host-to-device copy of the same size measured in the same run.

    .venv/bin/python bench/gpu.py [PATH ...] [--repeat N] [--out DIR]

Needs the ``cuda`` extra and a GPU. PATH defaults to every bundled real model (placed in
./models as ``hoist sample`` does). With ``--out`` (or ``$OUT``) the figures are also
written to ``DIR/gpu.json``: one entry per file under ``files``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# this directory holds bench/service.py, which would shadow the ``service`` package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import numpy as np  # noqa: E402

MODES = ["none", "mmap", "mlock", "mmap+mlock", "direct-io"]


def pinned_copy_seconds(nbytes: int, repeat: int) -> float:
    """Median time of one pinned host-to-device copy of ``nbytes``."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def check_on_device(model: Any, path: str) -> int:
    """Compare every tensor on the GPU with the file's bytes (on the GPU); returns the
    bytes checked there. Raises AssertionError on a mismatch."""
    import torch

    raw = np.memmap(path, dtype=np.uint8, mode="r")
    checked = 0
    tensors = list(model.tensors.values()) + ([model.tied_output] if model.tied_output else [])
    for t in tensors:
        w = model.index[t.name]
        ref = np.asarray(raw[w.offset : w.end])
        if hasattr(t.data, "device"):
            expected = torch.from_numpy(ref.copy()).to(t.data.device)
            assert torch.equal(t.data.reshape(-1), expected), t.name
            checked += t.nbytes
        else:
            assert np.asarray(t.data).tobytes() == ref.tobytes(), t.name
    return checked


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="*", type=Path, metavar="PATH")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default=os.environ.get("OUT"))
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        sys.stderr.write("no CUDA GPU\n")
        return 2
    if not args.paths:
        from service.sample import place_samples

        args.paths = place_samples(Path("models"))
    results: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0), "files": []}
    for path in args.paths:
        sys.stdout.write(f"file: {path}\n")
        results["files"].append(bench_file(str(path), args.repeat))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu.json").write_text(json.dumps(results, indent=1))
    return 0


def bench_file(path: str, repeat: int) -> dict[str, Any]:
    """Every load mode on ``path`` with ``-ngl 99``; prints a line per mode and returns the figures.

    Raises:
        AssertionError: a tensor on the GPU differs from the file's bytes.
    """
    import torch

    from service.loader.devices import discover_devices
    from service.loader.pipeline import load_model
    from service.loader.placement import make_params
    from service.loader.weights import open_model

    index = open_model(path)
    devices = discover_devices(None)
    results: dict[str, Any] = {"file": path, "modes": {}}
    for mode in MODES:
        params = make_params([d.default_buffer_type.name for d in devices], n_gpu_layers=99, load_mode=mode)
        times = []
        for i in range(repeat):
            start = time.perf_counter()
            model = asyncio.run(load_model(index, devices=devices, params=params))
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            if i == 0:
                on_gpu = check_on_device(model, path)
                lines = model.plan.buffer_lines()
                stats = model.stats.to_dict()
            model.close()
        seconds = statistics.median(times)
        base = pinned_copy_seconds(on_gpu, 5)
        results["modes"][mode] = {
            "seconds": seconds,
            "bytes_on_gpu": on_gpu,
            "upload_gb_s": on_gpu / seconds / 1e9,
            "pinned_copy_gb_s": on_gpu / base / 1e9,
            "ratio_to_pinned_copy": base / seconds,
            "buffer_lines": lines,
            "stats": stats,
        }
        sys.stdout.write(
            f"{mode:<11} {seconds * 1000:8.1f} ms  {on_gpu / seconds / 1e9:6.2f} GB/s to the GPU "
            f"(pinned copy {on_gpu / base / 1e9:6.2f} GB/s, ratio {base / seconds:.3f}); every tensor verified\n"
        )
        sys.stdout.flush()
    return results


if __name__ == "__main__":
    sys.exit(main())
