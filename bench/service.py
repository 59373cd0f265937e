"""Polling a busy service: many clients follow load jobs while loads run.

    .venv/bin/python bench/service.py [PATH | --sample NAME] [--pollers 200] [--loads 3] [--interval 0.1]

Starts ``hoist serve`` (an emulated GPU whose uploads are paced, so that the loads last a
few seconds), then in this process: ``--pollers`` clients that each poll one of the
jobs (``GET /v1/loads/{id}``) every ``--interval`` seconds, first while nothing loads
(the baseline), then while ``--loads`` loads of PATH (default: the bundled model named by
``--sample``, gemma3 unless given, placed with ``hoist sample``) run at once. Prints the
poll latency p50 / p99 / max of both phases, their ratio, and how long each load took.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
# this script's own name would shadow the ``service`` package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class _Connection:
    """A keep-alive HTTP/1.1 connection with just what polling needs: a client as light as
    can be, so that the machine's CPU goes to the server being measured."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def get(self, path: str) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        self.writer.write(f"GET {path} HTTP/1.1\r\nHost: {self.host}\r\n\r\n".encode())
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return status, await self.reader.readexactly(length)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            await self.writer.wait_closed()


async def _poll(base: str, urls: list[str], interval: float, stop: asyncio.Event) -> list[float]:
    """Poll the URLs in turn until ``stop``; the latency of each poll in seconds."""
    host, port = base.removeprefix("http://").split(":")
    conn = _Connection(host, int(port))
    latencies: list[float] = []
    i = 0
    try:
        while not stop.is_set():
            started = time.perf_counter()
            status, _ = await conn.get(urls[i % len(urls)])
            latencies.append(time.perf_counter() - started)
            if status != 200:
                raise RuntimeError(f"GET {urls[i % len(urls)]}: {status}")
            i += 1
            await asyncio.sleep(max(0.0, interval - (time.perf_counter() - started)))
    finally:
        await conn.close()
    return latencies


async def _phase(
    base: str, urls: list[str], pollers: int, interval: float, until: asyncio.Future[None] | float
) -> list[float]:
    stop = asyncio.Event()
    tasks = [asyncio.create_task(_poll(base, urls, interval, stop)) for _ in range(pollers)]
    if isinstance(until, float):
        await asyncio.sleep(until)
    else:
        await until
    stop.set()
    results = await asyncio.gather(*tasks)
    return [x for r in results for x in r]


def _report(name: str, latencies: list[float]) -> tuple[float, float]:
    p50, p99 = _percentile(latencies, 0.5), _percentile(latencies, 0.99)
    _say(
        f"{name:>14}: {len(latencies):6d} polls, p50 {p50 * 1000:7.1f} ms, p99 {p99 * 1000:7.1f} ms, "
        f"max {max(latencies) * 1000:7.1f} ms"
    )
    return p50, p99


async def run(args: argparse.Namespace, base: str, model: str) -> None:
    body = {"model": model, "load_mode": args.load_mode, "n_gpu_layers": 99}
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        # a finished job to poll during the baseline phase
        first = await client.post("/v1/loads", json=body)
        first.raise_for_status()
        idle_url = first.headers["location"]
        while (await client.get(idle_url)).json()["state"] not in ("succeeded", "failed", "cancelled"):
            await asyncio.sleep(0.05)
        await client.delete(f"/v1/models/{first.json()['id']}")
        idle = await _phase(base, [idle_url], args.pollers, args.interval, args.baseline_s)

        jobs = []
        for i in range(args.loads):
            # a name each: loads of one file under one name would share its copy
            resp = await client.post("/v1/loads", json={**body, "name": f"bench-{i}"})
            resp.raise_for_status()
            jobs.append(resp.headers["location"])
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        async def watch() -> list[dict[str, object]]:
            async with httpx.AsyncClient(base_url=base, timeout=60) as watcher:
                while True:
                    states = [(await watcher.get(u)).json() for u in jobs]
                    if all(s["state"] in ("succeeded", "failed", "cancelled") for s in states):
                        done.set_result(None)
                        return states
                    await asyncio.sleep(0.1)

        watching = asyncio.create_task(watch())
        busy = await _phase(base, jobs, args.pollers, args.interval, done)
        states = await watching
    _say(f"{args.pollers} pollers, one poll each per {args.interval:g} s; {args.loads} loads of {model}")
    _, idle_p99 = _report("idle", idle)
    _, busy_p99 = _report(f"{args.loads} loads running", busy)
    _say(f"p99 during loads / p99 idle: {busy_p99 / idle_p99:.2f}")
    for s in states:
        started, finished = s["started_at"], s["finished_at"]
        took = _seconds(str(finished)) - _seconds(str(started)) if started and finished else float("nan")
        _say(f"  load {s['id']}: {s['state']}, {took:.2f} s")


def _seconds(iso: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(iso).timestamp()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", nargs="?", default=None, help="model file (default: the bundled model --sample)")
    parser.add_argument("--sample", default="gemma3", help="which bundled model when no PATH is given")
    parser.add_argument("--pollers", type=int, default=200)
    parser.add_argument("--loads", type=int, default=3)
    parser.add_argument("--interval", type=float, default=0.1, help="seconds between one poller's polls")
    parser.add_argument("--baseline-s", type=float, default=3.0, help="length of the idle phase")
    parser.add_argument("--load-mode", default="none")
    parser.add_argument("--bandwidth", default="100MiB", help="upload pace of the emulated GPU")
    args = parser.parse_args()
    if args.path is None:
        from service.sample import place_sample

        path = place_sample(str(ROOT / "models"), args.sample)
    else:
        path = Path(args.path).resolve()
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOIST_")}
    env.update(
        HOIST_MODELS_DIR=str(path.parent),
        HOIST_CUDA="0",
        HOIST_EMULATED_DEVICES=f"EMU0=64GiB:bandwidth={args.bandwidth}",
        HOIST_MAX_CONCURRENT_LOADS=str(args.loads),
    )
    server = subprocess.Popen(
        [sys.executable, "-c", "import sys; from service.cli import main; sys.exit(main())", "serve"]
        + ["--port", str(port), "--log-level", "warning"],
        env=env,
        cwd=ROOT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("hoist serve did not start")
            time.sleep(0.1)
        asyncio.run(run(args, base, path.name))
    finally:
        server.terminate()
        server.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
