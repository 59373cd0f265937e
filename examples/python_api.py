"""hoist's Python API: load a GGUF model in this process and follow its events.

    python examples/python_api.py MODEL.gguf [--emulated-devices "EMU0=2GiB:bandwidth=512MiB"] [--stop-at 0.5]

Prints each event (kind, sequence number, bytes done / total, per device) and the memory
report; with ``--stop-at F`` the progress callback returns False once a fraction F is
done, which cancels the load (everything it took is released).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from service.api.local import LocalLoad
from service.errors import LoadCancelledError
from service.loader.devices import discover_devices
from service.loader.pipeline import LoadOptions, Progress
from service.loader.placement import LoadMode, PlacementParams
from service.loader.weights import open_model


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--emulated-devices", default="EMU0=2GiB:bandwidth=512MiB")
    parser.add_argument("--stop-at", type=float, default=None, help="cancel once this fraction is done")
    args = parser.parse_args()

    def on_progress(p: Progress) -> bool:
        # llama.cpp's progress_callback: False stops the load
        return args.stop_at is None or p.fraction < args.stop_at

    load = LocalLoad(
        open_model(args.model),
        devices=discover_devices(args.emulated_devices, cuda=False),
        params=PlacementParams(n_gpu_layers=99, load_mode=LoadMode.NONE),
        options=LoadOptions(staging_buffers=1, staging_nbytes=1 << 20),
        on_progress=on_progress,
    )
    async for event in load.events():
        e = event.json()
        sys.stdout.write(f"{e['event']:9} seq={e['seq']:<4} {e['bytes_done']}/{e['bytes_total']} {e['by_device']}\n")
    try:
        model = await load.result()
    except LoadCancelledError as exc:
        sys.stdout.write(f"cancelled: {exc.message}\n")
        return 1
    with model:
        for line in model.report.lines():
            sys.stdout.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
