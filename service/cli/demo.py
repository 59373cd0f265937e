"""``hoist demo``: place the sample model, serve, and load it through the HTTP API as a
client would (``POST /v1/loads``, then follow the job's events until it ends)."""

from __future__ import annotations

import argparse
import asyncio
import json

from rich.markup import escape

from service.cli.commands import models_dir_for
from service.cli.console import err, run
from service.cli.serve import check_exposure, check_port_free, settings_for
from service.cli.watch import follow, show_end


async def _demo(args: argparse.Namespace) -> int:
    import httpx
    import uvicorn

    from service.api.app import create_app
    from service.api.server import server_config
    from service.sample import place_sample

    models_dir = models_dir_for(args)
    check_port_free(args.host, args.port)
    err.print(f"placing the sample model in {models_dir}/ ...")
    sample = await asyncio.to_thread(place_sample, models_dir)
    settings = settings_for(args, models_dir)
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
    final = await follow(base, location.rsplit("/", 1)[-1], token)
    status = show_end(final)
    err.print(f"still serving on {base} (try {base}/v1/devices); press Ctrl-C to stop")
    await serving
    return status


def cmd_demo(args: argparse.Namespace) -> int:
    """``hoist demo``: place the sample, serve, and load it through the HTTP API."""
    return run(_demo(args))
