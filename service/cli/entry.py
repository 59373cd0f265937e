"""The ``hoist`` command's entry point: parse, set up logging, run the command, and turn
the errors hoist anticipates into one line on stderr and an exit status."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Sequence

from service.cli.exit_codes import EXIT_DOES_NOT_FIT, EXIT_ERROR, EXIT_INTERRUPTED, EXIT_USAGE
from service.cli.parser import parse_args
from service.errors import BudgetExceededError, HoistError


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hoist`` command; returns the exit status."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", handlers=[_CLIHandler()])
    logging.getLogger("httpx").setLevel(logging.WARNING)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except HoistError as exc:
        from rich.markup import escape

        from service.cli.console import err
        from service.loader.summary import printable

        err.print(f"[red]hoist: error:[/red] {escape(printable(exc.describe()))}")
        return EXIT_DOES_NOT_FIT if isinstance(exc, BudgetExceededError) else EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Exception as exc:
        from pydantic import ValidationError

        if isinstance(exc, ValidationError):
            from rich.markup import escape

            from service.cli.console import err

            msgs = "; ".join(e["msg"] for e in exc.errors())
            err.print(f"[red]hoist: error:[/red] invalid settings: {escape(msgs)}")
            return EXIT_USAGE
        raise


class _CLIHandler(logging.Handler):
    """The command's log handler, made at the first record (a command that logs nothing
    never loads rich): on a terminal, rich's, through the same console as the progress
    bars so that lines never garble them; elsewhere, plain lines that are never wrapped
    (:func:`service.logs.cli_handler`)."""

    def __init__(self) -> None:
        super().__init__()
        self._target: logging.Handler | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self._target is None:
            from service.cli.console import err
            from service.logs import cli_handler

            self._target = cli_handler(err)
            if self._target.formatter is None:
                self._target.setFormatter(self.formatter)
        self._target.handle(record)
