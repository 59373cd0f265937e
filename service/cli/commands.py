"""The model and device commands: ``inspect``, ``devices``, ``plan``, ``load`` and
``sample``; each takes the parsed command line and returns the exit status.

Each command imports what it uses when it runs (the placement planner, the load pipeline,
rich's console), so that ``hoist inspect`` reads a header without loading them."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING

from service.cli.exit_codes import EXIT_DOES_NOT_FIT, EXIT_OK

if TYPE_CHECKING:
    from service.loader import pipeline

DEFAULT_MODELS_DIR = "models"


def models_dir_for(args: argparse.Namespace) -> str:
    """``--models-dir``, else ``$HOIST_MODELS_DIR``, else :data:`DEFAULT_MODELS_DIR`."""
    models_dir: str | None = args.models_dir
    return models_dir or os.environ.get("HOIST_MODELS_DIR") or DEFAULT_MODELS_DIR


def cmd_inspect(args: argparse.Namespace) -> int:
    """``hoist inspect``: the model's metadata and tensors, as tables or (``--json``) JSON."""
    from service.cli.render import inspect_lines
    from service.loader.summary import summarize, write_json
    from service.loader.weights import open_model

    index = open_model(args.model)
    if args.json:
        write_json(summarize(index, lazy_arrays=True), sys.stdout)
        sys.stdout.write("\n")
        return 0
    sys.stdout.write("\n".join(inspect_lines(index)) + "\n")
    return 0


def cmd_devices(args: argparse.Namespace) -> int:
    """``hoist devices``: each device's memory, buffer types and capabilities."""
    from service.cli.console import out
    from service.cli.options import devices_for
    from service.cli.render import device_line

    devices = devices_for(args)
    if args.json:
        sys.stdout.write(json.dumps([d.to_dict() for d in devices], indent=1) + "\n")
        return 0
    for d in devices:
        out.print(device_line(d))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """``hoist plan``: where every tensor would go; :data:`EXIT_DOES_NOT_FIT` when it does not fit."""
    from service.cli.options import devices_for, placement_params
    from service.cli.render import print_plan
    from service.loader.placement import MemorySnapshot, plan
    from service.loader.weights import open_model

    devices = devices_for(args)
    params = placement_params(args, devices)
    index = open_model(args.model)
    p = plan(index, devices, params, memory=MemorySnapshot.take(devices))
    if args.json:
        sys.stdout.write(json.dumps(p.to_dict(), indent=1) + "\n")
    else:
        print_plan(p, verbose=args.verbose)
    return EXIT_OK if p.fits else EXIT_DOES_NOT_FIT


async def _load(args: argparse.Namespace) -> int:
    import asyncio
    import time

    from rich.markup import escape

    from service.cli.console import err, progress_bar
    from service.cli.options import devices_for, load_options, placement_params
    from service.cli.render import print_plan
    from service.loader import pipeline
    from service.loader.weights import open_model

    devices = devices_for(args)
    params = placement_params(args, devices)
    index = await asyncio.to_thread(open_model, args.model)
    start = time.perf_counter()
    bar = progress_bar()
    task = bar.add_task("load", total=index.nbytes)

    def on_progress(p: pipeline.Progress) -> None:
        if p.bytes_done and err.is_terminal and not bar.live.is_started:
            bar.start()
        bar.update(task, completed=p.bytes_done, total=p.bytes_total)

    try:
        model = await pipeline.load_model(
            index, devices=devices, params=params, options=load_options(args), on_progress=on_progress
        )
    finally:
        if bar.live.is_started:
            bar.stop()
    seconds = time.perf_counter() - start
    with model:
        if args.json:
            data = {
                "path": index.path,
                "load_mode": model.load_mode,
                "n_tensors": len(model),
                "tensor_bytes": index.nbytes,
                "seconds": round(seconds, 4),
                "plan": model.plan.to_dict(tensors=False),
                "memory": model.report.to_dict(),
                "warnings": model.warnings,
                "stats": model.stats.to_dict(),
            }
            if args.hash_tensors:
                data["tensor_hashes"] = {"algorithm": "xxh3_64", "tensors": model.tensor_hashes}
            sys.stdout.write(json.dumps(data, indent=1) + "\n")
        else:
            err.print(f"loaded {len(model)} tensors in {seconds:.2f} s")
            if args.hash_tensors:
                err.print(f"hashed {len(model.tensor_hashes)} tensors (xxh3_64; --json lists them)")
            for warning in model.warnings:
                if warning not in model.plan.warnings:  # those come with the plan
                    err.print(f"[yellow]warning:[/yellow] {escape(warning)}")
            print_plan(model.plan, verbose=args.verbose)
    return 0


def cmd_load(args: argparse.Namespace) -> int:
    """``hoist load``: load the model onto its devices and print the plan and memory report."""
    from service.cli.console import run

    return run(_load(args))


def cmd_sample(args: argparse.Namespace) -> int:
    """``hoist sample``: place the bundled real models in the models directory; prints their paths."""
    from service.cli.console import out
    from service.sample import place_samples

    for path in place_samples(models_dir_for(args), args.names):
        out.print(str(path))
    return 0
