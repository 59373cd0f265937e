"""The CLI's progress bar keeps one line per load on a narrow terminal."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from service.cli.console import progress_bar


@pytest.mark.parametrize("width", [80, 100, 200])
def test_progress_bar_is_one_line_with_its_figures_whole(width: int) -> None:
    bar = progress_bar(label="{task.description}", transient=False)
    label = "loading gemma-3-270m-q4_k_m.gguf"
    task = bar.add_task(label, total=424_845_824)
    bar.update(task, completed=424_845_824)
    bar.tasks[0].finished_speed = 848.4e6  # as the speed column shows it: "848.4 MB/s"
    screen = io.StringIO()
    Console(file=screen, width=width, color_system=None).print(bar.make_tasks_table(bar.tasks))
    lines = screen.getvalue().splitlines()
    assert len(lines) == 1, lines  # no column wrapped onto a second line
    assert len(lines[0]) <= width
    assert label in lines[0] and "405.2/405.2 MiB" in lines[0]  # 424,845,824 B = 405.17 MiB
    assert "848.4 MB/s" in lines[0]
