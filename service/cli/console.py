"""Where the ``hoist`` command writes: results on stdout (:data:`out`), notes, progress
and errors on stderr (:data:`err`); and how a command runs its coroutine."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

out = Console(highlight=False, soft_wrap=True, markup=False)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def run(coro: Coroutine[Any, Any, int]) -> int:
    """Run a command's coroutine on uvloop; returns its exit status."""
    import uvloop

    return uvloop.run(coro)


def progress_bar() -> Progress:
    """A transient byte-count progress bar on :data:`err` (not started)."""
    return Progress(
        TextColumn("[bold]loading"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=True,
    )
