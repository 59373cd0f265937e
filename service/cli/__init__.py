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

from service.cli.entry import main
from service.cli.exit_codes import EXIT_DOES_NOT_FIT, EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE
from service.cli.options import devices_for, load_options, placement_params
from service.cli.parser import Parser, build_parser, parse_args

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
