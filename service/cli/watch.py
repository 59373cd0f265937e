"""``hoist watch JOB_ID``: follow a load job's events from a running service over its
websocket (``/v1/loads/{id}/events``), with a progress bar that stays on screen and, at
the end, llama.cpp's offload lines, the memory report and the load time; ``hoist demo``
follows its load the same way."""

from __future__ import annotations

import argparse
import json
import os
import urllib.parse
from typing import Any

from rich.markup import escape
from rich.progress import Progress

from service.cli.console import err, out, progress_bar, run
from service.cli.exit_codes import EXIT_ERROR, EXIT_OK


def _bar() -> Progress:
    """A byte-count progress bar on stderr that stays on screen when it stops."""
    return progress_bar(label="{task.description}", transient=False)


async def follow(base: str, job_id: str, token: str | None) -> dict[str, Any]:
    """Follow job ``job_id`` of the service at ``base`` until its final event, drawing a
    progress bar; returns the final event (``report``, ``error`` or a ``state`` of
    ``cancelled``).

    Raises:
        websockets.InvalidStatus: the handshake was refused (unknown job: 404, token: 401).
        OSError: the service cannot be reached.
        ConnectionError: the stream ended without a final event.
    """
    import websockets

    url = base.replace("http://", "ws://", 1).replace("https://", "wss://", 1).rstrip("/")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    events_url = f"{url}/v1/loads/{urllib.parse.quote(job_id, safe='')}/events"
    # the bar appears once the service accepted the stream, so that a refusal is one line
    async with websockets.connect(events_url, additional_headers=headers) as ws:
        with _bar() as bar:
            task = bar.add_task(f"loading {escape(job_id)}", total=None)
            async for message in ws:
                event: dict[str, Any] = json.loads(message)
                if event["event"] == "snapshot":
                    bar.update(task, description=f"loading {escape(str(event.get('model', job_id)))}")
                if event["event"] == "warning":
                    bar.console.print(f"[yellow]warning:[/yellow] {escape(event['warning'])}")
                bar.update(task, completed=event["bytes_done"], total=event["bytes_total"] or None)
                if event["final"]:
                    return event
    raise ConnectionError(f"the events of load job {job_id} ended without a final event")


def show_end(event: dict[str, Any]) -> int:
    """Print how a followed load ended; its exit status."""
    if event["event"] == "report":
        report = event["report"]
        memory_lines = (report.get("memory") or {}).get("lines") or []
        # the plan's lines end with the planned buffer lines: the report's measured ones replace them
        for line in report.get("plan_lines") or []:
            if "model buffer size" not in line:
                out.print(line)
        for line in memory_lines:
            out.print(line)
        took = report.get("load_time_s")
        err.print(f"loaded {event['bytes_done']} bytes as {report['model_id']}" + (f" in {took:.2f} s" if took else ""))
        return EXIT_OK
    if event["event"] == "error":
        error = event.get("error") or {}
        err.print(f"[red]load failed ({escape(str(error.get('code')))}):[/red] {escape(str(error.get('message')))}")
    else:
        err.print(f"[red]load {escape(event['state'])}[/red]")
    return EXIT_ERROR


async def _watch(args: argparse.Namespace) -> int:
    import websockets

    token = os.environ.get("HOIST_API_TOKEN") or None
    try:
        final = await follow(args.url, args.job_id, token)
    except websockets.InvalidStatus as exc:
        try:
            detail = json.loads(exc.response.body or b"{}").get("detail", "")
        except ValueError:
            detail = ""
        err.print(f"[red]refused ({exc.response.status_code}):[/red] {escape(str(detail))}")
        return EXIT_ERROR
    except (OSError, ConnectionError, websockets.ConnectionClosedError, websockets.InvalidURI) as exc:
        err.print(f"[red]cannot follow load job {escape(args.job_id)} at {escape(args.url)}:[/red] {escape(str(exc))}")
        return EXIT_ERROR
    return show_end(final)


def cmd_watch(args: argparse.Namespace) -> int:
    """``hoist watch JOB_ID``: follow a load job of a running service to its end."""
    return run(_watch(args))
