"""The ``hoist`` command: ``serve``, ``inspect``, ``devices``, ``plan``, ``load``,
``sample`` and ``demo``.

Errors hoist anticipates are printed as one line on stderr with a non-zero exit status
(:data:`EXIT_ERROR`, :data:`EXIT_USAGE`, :data:`EXIT_DOES_NOT_FIT`), never as a traceback.

Modules: :mod:`~service.cli.parser` (the command line), :mod:`~service.cli.commands`
(``inspect``, ``devices``, ``plan``, ``load``, ``sample``), :mod:`~service.cli.serve`,
:mod:`~service.cli.demo` (the HTTP API's client), :mod:`~service.cli.render` (text
output), :mod:`~service.cli.options` (flags as the loader's inputs),
:mod:`~service.cli.entry` (:func:`main`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from service.cli.entry import main
from service.cli.exit_codes import EXIT_DOES_NOT_FIT, EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE
from service.cli.parser import Parser, build_parser, parse_args

if TYPE_CHECKING:
    from service.cli.options import devices_for, load_options, placement_params

__all__ = [
    "EXIT_DOES_NOT_FIT",
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "Parser",
    "build_parser",
    "devices_for",
    "load_options",
    "main",
    "parse_args",
    "placement_params",
]


def __getattr__(name: str) -> Any:
    """The flag converters of :mod:`~service.cli.options`, imported when first used (they
    load the devices and the pipeline, which ``hoist --help`` needs not)."""
    if name in ("devices_for", "load_options", "placement_params"):
        from service.cli import options

        return getattr(options, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
