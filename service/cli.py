"""The ``hoist`` command: ``serve``, ``inspect``, ``devices``, ``plan``, ``load``,
``sample`` and ``demo``.

Errors hoist anticipates are printed as one line on stderr with a non-zero exit status
(:data:`EXIT_ERROR`, :data:`EXIT_USAGE`, :data:`EXIT_DOES_NOT_FIT`), never as a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import logging.config
import os
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from service import __version__
from service.errors import BudgetExceededError, HoistError
from service.loader import pipeline
from service.loader.devices import Device, discover_devices, parse_size
from service.loader.placement import (
    LazyMode,
    LoadMode,
    MemorySnapshot,
    PlacementParams,
    Plan,
    SplitMode,
    make_params,
    plan,
)
from service.loader.summary import printable, summarize, value_text, write_json
from service.loader.weights import open_model
from service.sample import SAMPLES

MiB = 1 << 20

out = Console(highlight=False, soft_wrap=True, markup=False)
err = Console(stderr=True, highlight=False, soft_wrap=True)

DEFAULT_MODELS_DIR = "models"

EXIT_OK = 0
EXIT_ERROR = 1
"""A file, flag value, placement or load hoist refuses (the message says which)."""
EXIT_USAGE = 2
"""The command line itself: an unknown option, a missing or doubled model path."""
EXIT_DOES_NOT_FIT = 3
"""The model does not fit the devices' free memory (``plan`` says so; ``load`` refuses)."""
EXIT_INTERRUPTED = 130


def _run(coro: Coroutine[Any, Any, int]) -> int:
    import uvloop

    return uvloop.run(coro)


def _progress_bar() -> Progress:
    return Progress(
        TextColumn("[bold]loading"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=True,
    )


# -- inspect ------------------------------------------------------------------------------


def _columns(rows: Sequence[tuple[str, ...]], right: frozenset[int] = frozenset()) -> list[str]:
    """Rows as aligned text columns (plain text: fast for any number of rows)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in rows
    ]


def cmd_inspect(args: argparse.Namespace) -> int:
    index = open_model(args.model)
    if args.json:
        write_json(summarize(index, lazy_arrays=True), sys.stdout)
        sys.stdout.write("\n")
        return 0
    info = summarize(index, max_items=8)
    lines = [
        printable(info["path"]),
        f"file format = {info['file_format']}, {info['byte_order']}-endian",
        f"file type   = {info['file_type_name']}",
        f"file size   = {info['size']} of tensor data; {info['file_size_bytes']} bytes on disk",
        f"tensors     = {info['n_tensors']} ({', '.join(f'{t}: {n}' for t, n in info['tensor_types'].items())})",
    ]
    if len(info["splits"]) > 1:
        lines.append(f"splits      = {len(info['splits'])}")
        lines += [f"  {s['index'] + 1}: {printable(s['path'])} ({s['n_tensors']} tensors)" for s in info["splits"]]
    lines += ["", f"KV metadata: {len(info['metadata'])}"]
    kv = [("key", "type", "value")]
    kv += [(printable(e.key), e.type_name, value_text(e.value)) for e in index.metadata.kv.values()]
    lines += _columns(kv)
    lines += ["", f"tensors: {info['n_tensors']}"]
    split = len(info["splits"]) > 1
    rows = [("name", "type", "ne", "bytes", "offset")]
    rows += [
        (
            printable(t["name"]),
            t["type"],
            str(tuple(t["ne"])),
            str(t["bytes"]),
            f"{t['split'] + 1}:{t['offset']}" if split else str(t["offset"]),
        )
        for t in info["tensors"]
    ]
    lines += _columns(rows, right=frozenset({3, 4}))
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


# -- devices, plan, load -----------------------------------------------------------------


def _devices(args: argparse.Namespace) -> list[Device]:
    return discover_devices(args.emulated_devices, cuda=not args.no_cuda)


def _params(args: argparse.Namespace, devices: list[Device]) -> PlacementParams:
    return make_params(
        [d.default_buffer_type.name for d in devices],
        n_gpu_layers=args.n_gpu_layers,
        split_mode=args.split_mode,
        main_gpu=args.main_gpu,
        tensor_split=args.tensor_split,
        override_tensor=args.override_tensor or [],
        no_host=args.no_host,
        load_mode=args.load_mode,
        lazy_mode=args.lazy_mode,
    )


def _options(args: argparse.Namespace) -> pipeline.LoadOptions:
    return pipeline.LoadOptions(
        staging_buffers=args.staging_buffers,
        staging_nbytes=None if args.staging_size is None else parse_size(args.staging_size),
        check_tensors=args.check_tensors,
    )


def _layer_ranges(layers: dict[str, str]) -> str:
    """``input CPU; blk.0-8 CPU; blk.9-13 EMU0; output EMU1``."""
    parts: list[str] = [f"input {layers['input']}"]
    blocks = [(int(k[4:]), v) for k, v in layers.items() if k.startswith("blk.")]
    start = 0
    for i, (n, dev) in enumerate(blocks):
        if i + 1 == len(blocks) or blocks[i + 1][1] != dev:
            first = blocks[start][0]
            parts.append(f"blk.{first} {dev}" if first == n else f"blk.{first}-{n} {dev}")
            start = i + 1
    parts.append(f"output {layers['output']}")
    return "; ".join(parts)


def _print_plan(p: Plan, *, verbose: bool = False) -> None:
    devices = ", ".join(p.devices) or "none (CPU only)"
    err.print(f"devices: {devices}; load mode: {escape(p.load_mode_label)}")
    err.print(f"layers: {_layer_ranges(p.layers)}")
    for w in p.warnings:
        err.print(f"[yellow]warning:[/yellow] {escape(w)}")
    if p.moved is not None and verbose:
        err.print(escape(p.moved.line()))
    for line in p.offload_lines():
        out.print(line)
    for line in p.buffer_lines():
        out.print(line)
    for u in p.device_use:
        verdict = "fits" if u.fits else "[red]DOES NOT FIT[/red]"
        mapped = f" (+{u.mapped / MiB:.2f} MiB mapped)" if u.mapped else ""
        err.print(f"{u.device}: {u.allocated / MiB:.2f} MiB{mapped} of {u.free / MiB:.2f} MiB free: {verdict}")


def cmd_devices(args: argparse.Namespace) -> int:
    devices = _devices(args)
    if args.json:
        sys.stdout.write(json.dumps([d.to_dict() for d in devices], indent=1) + "\n")
        return 0
    for d in devices:
        mem = d.memory()
        caps = ", ".join(k for k, v in d.caps.to_dict().items() if v) or "-"
        extra = f"; largest allocation {d.max_alloc_nbytes / MiB:.0f} MiB" if d.max_alloc_nbytes else ""
        if d.unsupported:
            extra += f"; refuses {'+'.join(sorted(d.unsupported))}"
        out.print(
            f"{d.name:<8} {d.type:<4} {mem.free / MiB:10.0f} / {mem.total / MiB:.0f} MiB free  "
            f"buffer types: {', '.join(b.name for b in d.buffer_types())}; caps: {caps}{extra}; "
            f"{printable(d.description)}"
        )
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    devices = _devices(args)
    params = _params(args, devices)
    index = open_model(args.model)
    p = plan(index, devices, params, memory=MemorySnapshot.take(devices))
    if args.json:
        sys.stdout.write(json.dumps(p.to_dict(), indent=1) + "\n")
    else:
        _print_plan(p, verbose=args.verbose)
    return EXIT_OK if p.fits else EXIT_DOES_NOT_FIT


async def _load(args: argparse.Namespace) -> int:
    devices = _devices(args)
    params = _params(args, devices)
    index = await asyncio.to_thread(open_model, args.model)
    start = time.perf_counter()
    bar = _progress_bar()
    task = bar.add_task("load", total=index.nbytes)

    def on_progress(p: pipeline.Progress) -> None:
        if p.bytes_done and err.is_terminal and not bar.live.is_started:
            bar.start()
        bar.update(task, completed=p.bytes_done, total=p.bytes_total)

    try:
        model = await pipeline.load_model(
            index, devices=devices, params=params, options=_options(args), on_progress=on_progress
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
            sys.stdout.write(json.dumps(data, indent=1) + "\n")
        else:
            err.print(f"loaded {len(model)} tensors in {seconds:.2f} s")
            for warning in model.warnings:
                if warning not in model.plan.warnings:  # those come with the plan
                    err.print(f"[yellow]warning:[/yellow] {escape(warning)}")
            _print_plan(model.plan, verbose=args.verbose)
    return 0


def cmd_load(args: argparse.Namespace) -> int:
    return _run(_load(args))


# -- serve, sample, demo ------------------------------------------------------------------


def _settings(args: argparse.Namespace, models_dir: str | None) -> Any:
    from service.api.settings import Settings

    overrides: dict[str, Any] = {"emulated_devices": args.emulated_devices, "cuda": not args.no_cuda}
    if models_dir is not None:
        overrides["models_dir"] = Path(models_dir)
    if getattr(args, "allow_unauthenticated", False):
        overrides["allow_unauthenticated"] = True
    return Settings(**overrides)


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback address (``127.0.0.1``,
    ``::1``, ``localhost``); an unresolvable name counts as not loopback."""
    import ipaddress
    import socket

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)


def check_exposure(host: str, settings: Any) -> None:
    """Refuse to serve without a token on an address other hosts can reach, unless the
    settings say so explicitly.

    Raises:
        RequestError: no token, not loopback, and ``allow_unauthenticated`` not set.
    """
    from service.errors import RequestError

    if settings.token() is None and not settings.allow_unauthenticated and not is_loopback(host):
        raise RequestError(
            f"refusing to serve on {host} without an API token: anyone who reaches it could load and unload models",
            hint="set HOIST_API_TOKEN or HOIST_API_TOKEN_FILE, or, if the network in front of hoist is trusted, "
            "pass --allow-unauthenticated (or set HOIST_ALLOW_UNAUTHENTICATED=1)",
        )


def _check_port_free(host: str, port: int) -> None:
    """Raise RequestError when ``host:port`` cannot be bound (in use, or not ours)."""
    import socket

    from service.errors import RequestError

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise RequestError(f"cannot resolve host '{host}': {exc}") from exc
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            raise RequestError(
                f"cannot listen on {host}:{port}: {exc.strerror}", hint="choose another port with --port"
            ) from exc


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from service.api.app import create_app
    from service.api.server import raise_open_files_limit, server_config
    from service.logs import log_config

    settings = _settings(args, args.models_dir)
    logging.config.dictConfig(log_config(settings.log_format, args.log_level))  # before anything logs
    check_exposure(args.host, settings)
    raise_open_files_limit()
    app = create_app(settings)
    _check_port_free(args.host, args.port)
    uvicorn.Server(server_config(app, settings, host=args.host, port=args.port, log_level=args.log_level)).run()
    return 0


def cmd_sample(args: argparse.Namespace) -> int:
    from service.sample import place_samples

    models_dir = args.models_dir or os.environ.get("HOIST_MODELS_DIR", DEFAULT_MODELS_DIR)
    for path in place_samples(models_dir, args.names):
        out.print(str(path))
    return 0


async def _demo(args: argparse.Namespace) -> int:
    import httpx
    import uvicorn

    from service.api.app import create_app
    from service.api.server import server_config
    from service.sample import place_sample

    models_dir = args.models_dir or os.environ.get("HOIST_MODELS_DIR", DEFAULT_MODELS_DIR)
    _check_port_free(args.host, args.port)
    err.print(f"placing the sample model in {models_dir}/ ...")
    sample = await asyncio.to_thread(place_sample, models_dir)
    settings = _settings(args, models_dir)
    check_exposure(args.host, settings)
    token = settings.token()
    app = create_app(settings)
    server = uvicorn.Server(server_config(app, settings, host=args.host, port=args.port, log_level="warning"))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        if serving.done():
            await serving
            return 1
        await asyncio.sleep(0.05)
    base = f"http://{args.host}:{args.port}"
    err.print(f"hoist is serving on {base}")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(base_url=base, timeout=30, headers=headers) as client:
        body = {"model": sample.name, "load_mode": args.load_mode}
        err.print(f"POST /v1/loads {json.dumps(body)}")
        resp = await client.post("/v1/loads", json=body)
        if resp.status_code != 202:
            err.print(f"[red]load refused ({resp.status_code}):[/red] {escape(resp.text)}")
            server.should_exit = True
            await serving
            return 1
        location = resp.headers["location"]
        err.print(f"202 Accepted, Location: {location}")
        with _progress_bar() as bar:
            task = bar.add_task("load", total=resp.json()["bytes_total"])
            while True:
                job = (await client.get(location)).json()
                bar.update(task, completed=job["bytes_done"], total=job["bytes_total"])
                if job["state"] in ("succeeded", "failed", "cancelled"):
                    break
                await asyncio.sleep(0.1)
    if job["state"] != "succeeded":
        err.print(f"[red]load {job['state']}:[/red] {escape(str((job.get('error') or {}).get('message')))}")
    else:
        err.print(f"loaded {job['n_tensors']} tensors of {sample.name}; memory report:")
        for line in job["memory"]["lines"]:
            out.print(line)
    err.print(f"still serving on {base} (try {base}/v1/devices); press Ctrl-C to stop")
    await serving
    return 0 if job["state"] == "succeeded" else 1


def cmd_demo(args: argparse.Namespace) -> int:
    return _run(_demo(args))


# -- parser -------------------------------------------------------------------------------


class Parser(argparse.ArgumentParser):
    """An argument parser that takes option names only as written: no abbreviation is
    ever guessed (``-m`` is not ``-mg``, ``-n`` is not ``-ngl``, ``--no-h`` is not
    ``--no-host``), and no value is glued to an option name (``-mPATH``); ``-ngl=5``
    still works. Python 3.11's ``allow_abbrev=False`` leaves single-dash prefixes to be
    expanded, so this parser refuses them itself."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def _get_option_tuples(self, option_string: str) -> list[tuple[Any, ...]]:
        if self.allow_abbrev:
            return super()._get_option_tuples(option_string)
        return []


def _device_options() -> Parser:
    parent = Parser(add_help=False)
    parent.add_argument(
        "--emulated-devices",
        default=os.environ.get("HOIST_EMULATED_DEVICES"),
        metavar="SPEC",
        help='emulated GPUs, e.g. "EMU0=3000MiB,EMU1=1000MiB" (default: $HOIST_EMULATED_DEVICES)',
    )
    parent.add_argument("--no-cuda", action="store_true", help="do not use CUDA GPUs")
    return parent


def _load_mode_options() -> Parser:
    """``-lm`` and llama.cpp's former switches for it (resolved by :func:`_resolve_load_mode`)."""
    parent = Parser(add_help=False)
    parent.add_argument(
        "-lm",
        "--load-mode",
        default=None,
        choices=LoadMode.spellings(),
        help="how tensor data gets into memory (default auto; dio = direct-io)",
    )
    switches = parent.add_argument_group(
        "llama.cpp's former load switches", "each stands for a -lm value (a note on stderr says which)"
    )
    switches.add_argument("--mmap", dest="switch_mmap", action="store_true", default=None, help="-lm mmap")
    switches.add_argument("--no-mmap", dest="switch_mmap", action="store_false", help="-lm none")
    switches.add_argument(
        "--mlock", dest="switch_mlock", action="store_true", help="-lm mmap+mlock (-lm mlock with --no-mmap)"
    )
    switches.add_argument("-dio", "--direct-io", dest="switch_dio", action="store_true", help="-lm direct-io")
    return parent


def _resolve_load_mode(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Set ``args.load_mode`` from ``-lm`` or from llama.cpp's former switches (with a
    note naming the ``-lm`` value they stand for); the two together are a usage error."""
    used = [
        flag
        for flag, on in (
            ("--mmap", args.switch_mmap is True),
            ("--no-mmap", args.switch_mmap is False),
            ("--mlock", args.switch_mlock),
            ("--direct-io", args.switch_dio),
        )
        if on
    ]
    if not used:
        args.load_mode = args.load_mode or LoadMode.AUTO.value
        return
    mode = LoadMode.from_switches(
        use_mmap=args.switch_mmap is not False, use_mlock=args.switch_mlock, direct_io=args.switch_dio
    )
    if args.load_mode is not None:
        parser.error(f"-lm cannot be combined with {' '.join(used)}: use -lm {mode.value} alone")
    args.load_mode = mode.value
    err.print(f"note: {' '.join(used)} taken as -lm {mode.value}", markup=False)


def _placement_options() -> Parser:
    parent = Parser(add_help=False, parents=[_load_mode_options()])
    parent.add_argument(
        "-ngl",
        "--n-gpu-layers",
        "--gpu-layers",
        default=None,
        metavar="N",
        help="layers to offload, counting the output layer: an integer, 'all' or 'auto' (default all); "
        "a negative integer means all, as in llama.cpp",
    )
    parent.add_argument("-sm", "--split-mode", default=SplitMode.LAYER.value, choices=SplitMode.spellings())
    parent.add_argument("-mg", "--main-gpu", type=int, default=0, help="the device kept by split mode none")
    parent.add_argument("-ts", "--tensor-split", default=None, metavar="SPLIT", help="proportions per device, e.g. 3,1")
    parent.add_argument(
        "-ot",
        "--override-tensor",
        action="append",
        metavar="PATTERN=BUFT",
        help="buffer type for tensors matching a regex; repeatable, comma-separated; first match wins",
    )
    parent.add_argument("--no-host", action="store_true", help="no pinned host buffer type for CPU layers")
    parent.add_argument(
        "-lzm",
        "--lazy-mode",
        default=LazyMode.AUTO.value,
        choices=LazyMode.spellings(),
        help="read per-layer embedding tables on demand: auto (above 4 GiB), on, off",
    )
    return parent


def _load_options() -> Parser:
    parent = Parser(add_help=False)
    parent.add_argument(
        "--check-tensors", action="store_true", help="validate tensor data (NaN/Inf values and scales) while loading"
    )
    parent.add_argument(
        "--staging-buffers",
        type=int,
        default=pipeline.DEFAULT_STAGING_BUFFERS,
        metavar="N",
        help="staging buffers per device for uploads (default 4)",
    )
    parent.add_argument(
        "--staging-size", default=None, metavar="SIZE", help="staging buffer size (default 1MiB; 64MiB with direct-io)"
    )
    return parent


def _model_argument(p: argparse.ArgumentParser) -> None:
    """The model path: positional, or llama.cpp's ``-m/--model`` (one of the two)."""
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("path", nargs="?", help="the GGUF file, or the first split of a split model")
    model.add_argument(
        "-m", "--model", dest="model_option", metavar="PATH", help="the model path, as llama.cpp takes it"
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``hoist`` parser: every parser and subparser a :class:`Parser` (no
    abbreviations)."""
    parser = Parser(prog="hoist", description="Load GGUF models onto devices, as llama.cpp does.")
    parser.add_argument("--version", action="version", version=f"hoist {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    dev = _device_options()
    place = _placement_options()

    p = sub.add_parser("inspect", help="show a GGUF model's metadata and tensors", parents=[dev])
    _model_argument(p)
    p.add_argument("--json", action="store_true", help="print everything as JSON")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("devices", help="list the devices and their memory", parents=[dev])
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_devices)

    p = sub.add_parser("plan", help="show where every tensor would go (dry run)", parents=[dev, place])
    _model_argument(p)
    p.add_argument("-v", "--verbose", action="store_true", help="also show tensors moved off their buffer type")
    p.add_argument("--json", action="store_true", help="print the plan as JSON, every tensor included")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser(
        "load", help="load a model onto its devices and print the memory report", parents=[dev, place, _load_options()]
    )
    _model_argument(p)
    p.add_argument("-v", "--verbose", action="store_true", help="also show tensors moved off their buffer type")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=cmd_load)

    p = sub.add_parser("serve", help="run the HTTP service", parents=[dev])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--models-dir", default=None, help="models directory (default: $HOIST_MODELS_DIR or ./models)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="serve on a non-loopback address without an API token (only behind a trusted network)",
    )
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("sample", help="place the bundled real models in the models directory", parents=[dev])
    p.add_argument("names", nargs="*", metavar="NAME", help=f"which: {', '.join(SAMPLES)} (default: all)")
    p.add_argument("--models-dir", default=None, help="models directory (default: $HOIST_MODELS_DIR or ./models)")
    p.set_defaults(func=cmd_sample)

    p = sub.add_parser(
        "demo", help="place the sample, serve, and load it through the HTTP API", parents=[dev, _load_mode_options()]
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--models-dir", default=None, help="models directory (default: $HOIST_MODELS_DIR or ./models)")
    p.set_defaults(func=cmd_demo)
    for command in sub.choices.values():
        command.set_defaults(command_parser=command)  # for usage errors found after parsing
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line: ``args.model`` is the model path however it was given,
    ``args.load_mode`` the ``-lm`` value however it was spelled. Exits with
    :data:`EXIT_USAGE` on a usage error, as argparse does."""
    args = build_parser().parse_args(argv)
    if hasattr(args, "model_option"):
        args.model = args.model_option if args.model_option is not None else args.path
    if hasattr(args, "switch_mmap"):
        _resolve_load_mode(args, args.command_parser)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hoist`` command; returns the exit status."""
    args = parse_args(argv)
    from service.logs import cli_handler

    # on a terminal, log through the same console as the progress bars, so that lines
    # never garble them; elsewhere, plain lines that are never wrapped
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", handlers=[cli_handler(err)])
    logging.getLogger("httpx").setLevel(logging.WARNING)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except HoistError as exc:
        err.print(f"[red]hoist: error:[/red] {escape(printable(exc.describe()))}")
        return EXIT_DOES_NOT_FIT if isinstance(exc, BudgetExceededError) else EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Exception as exc:
        from pydantic import ValidationError

        if isinstance(exc, ValidationError):
            msgs = "; ".join(e["msg"] for e in exc.errors())
            err.print(f"[red]hoist: error:[/red] invalid settings: {escape(msgs)}")
            return EXIT_USAGE
        raise


if __name__ == "__main__":
    sys.exit(main())
