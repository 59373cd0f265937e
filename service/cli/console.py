"""Where the ``hoist`` command writes: results on stdout (:data:`out`), notes, progress
and errors on stderr (:data:`err`); and how a command runs its coroutine."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Column

out = Console(highlight=False, soft_wrap=True, markup=False)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def run(coro: Coroutine[Any, Any, int]) -> int:
    """Run a command's coroutine on uvloop; returns its exit status."""
    import uvloop

    return uvloop.run(coro)


def progress_bar(*, label: str = "loading", transient: bool = True) -> Progress:
    """A byte-count progress bar on :data:`err` (not started), each task labelled
    ``label`` (a rich format string: ``{task.description}`` gives the task's own), gone
    from the screen when it stops if ``transient``. No column wraps, so each task keeps one
    line (a long label put the byte count's unit alone on a second one); where the
    terminal is too narrow, columns are cut with an ellipsis."""
    return Progress(
        TextColumn(f"[bold]{label}", table_column=Column(no_wrap=True, overflow="ellipsis")),
        BarColumn(),
        DownloadColumn(binary_units=True, table_column=Column(no_wrap=True)),
        TransferSpeedColumn(table_column=Column(no_wrap=True)),
        TimeRemainingColumn(table_column=Column(no_wrap=True)),
        console=err,
        transient=transient,
    )
