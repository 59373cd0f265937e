"""The ``hoist`` command line: a :class:`Parser` that never guesses abbreviations, the
subcommands and their flags (llama.cpp's spellings among them), and :func:`parse_args`,
which settles the model path and ``-lm`` however they were given.

Building the parser imports no command: each subcommand's function is named here and
imported when it runs (:class:`Command`), so that ``hoist --help`` and usage errors load
neither the loader, the service nor rich."""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Sequence
from typing import Any

from service import __version__
from service.loader.modes import LazyMode, LoadMode, SplitMode
from service.sample import SAMPLES

DEFAULT_URL = "http://127.0.0.1:8000"
"""The service ``hoist watch`` follows when neither ``--url`` nor ``$HOIST_URL`` says."""

DEFAULT_STAGING_BUFFERS = 4
"""``--staging-buffers`` when not given (the load pipeline's default)."""


class Command:
    """A subcommand's function, ``module:function``, imported when it is called."""

    def __init__(self, target: str) -> None:
        self.module, self.name = target.split(":")

    def __call__(self, args: argparse.Namespace) -> int:
        func = getattr(importlib.import_module(self.module), self.name)
        status: int = func(args)
        return status

    def __repr__(self) -> str:
        return f"Command('{self.module}:{self.name}')"


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
    from service.cli.console import err

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
        "--hash-tensors",
        action="store_true",
        help="compute an xxh3_64 digest of every tensor's bytes while loading (listed by --json)",
    )
    parent.add_argument(
        "--staging-buffers",
        type=int,
        default=DEFAULT_STAGING_BUFFERS,
        metavar="N",
        help=f"staging buffers per device for uploads (default {DEFAULT_STAGING_BUFFERS})",
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
    p.set_defaults(func=Command("service.cli.commands:cmd_inspect"))

    p = sub.add_parser("devices", help="list the devices and their memory", parents=[dev])
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=Command("service.cli.commands:cmd_devices"))

    p = sub.add_parser("plan", help="show where every tensor would go (dry run)", parents=[dev, place])
    _model_argument(p)
    p.add_argument("-v", "--verbose", action="store_true", help="also show tensors moved off their buffer type")
    p.add_argument("--json", action="store_true", help="print the plan as JSON, every tensor included")
    p.set_defaults(func=Command("service.cli.commands:cmd_plan"))

    p = sub.add_parser(
        "load", help="load a model onto its devices and print the memory report", parents=[dev, place, _load_options()]
    )
    _model_argument(p)
    p.add_argument("-v", "--verbose", action="store_true", help="also show tensors moved off their buffer type")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=Command("service.cli.commands:cmd_load"))

    p = sub.add_parser("serve", help="run the HTTP service", parents=[dev])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--models-dir", default=None, help="models directory (default: $HOIST_MODELS_DIR or ./models)")
    p.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="the least severe messages logged, by the server and by hoist (default: info)",
    )
    p.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="serve on a non-loopback address without an API token (only behind a trusted network)",
    )
    p.set_defaults(func=Command("service.cli.serve:cmd_serve"))

    p = sub.add_parser("sample", help="place the bundled real models in the models directory", parents=[dev])
    p.add_argument("names", nargs="*", metavar="NAME", help=f"which: {', '.join(SAMPLES)} (default: all)")
    p.add_argument("--models-dir", default=None, help="models directory (default: $HOIST_MODELS_DIR or ./models)")
    p.set_defaults(func=Command("service.cli.commands:cmd_sample"))

    p = sub.add_parser(
        "demo", help="place the sample, serve, and load it through the HTTP API", parents=[dev, _load_mode_options()]
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--models-dir", default=None, help="models directory (default: $HOIST_MODELS_DIR or ./models)")
    p.set_defaults(func=Command("service.cli.demo:cmd_demo"))

    p = sub.add_parser("watch", help="follow a load job of a running service to its end")
    p.add_argument("job_id", metavar="JOB_ID", help="the load job (lj_...)")
    p.add_argument(
        "--url",
        default=os.environ.get("HOIST_URL", DEFAULT_URL),
        help=f"the service (default: $HOIST_URL or {DEFAULT_URL}); the token is $HOIST_API_TOKEN",
    )
    p.set_defaults(func=Command("service.cli.watch:cmd_watch"))
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
