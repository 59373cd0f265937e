"""``hoist serve``'s logs: one format for hoist's and uvicorn's records, with timestamps;
JSON lines with the job id and model of a load; llama.cpp's report lines verbatim; no
line wrapped."""

from __future__ import annotations

import io
import json
import logging
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from rich.console import Console

from service import cli
from service.logs import StderrHandler, TextFormatter, bind_load, cli_handler, log_config
from tests.api.test_loads import put, wait_for
from tests.conftest import ServeProcess
from tests.helpers import mixed_tensors, write_fixture

ENDED = {"succeeded", "failed", "cancelled"}
# a long name: the lines that name it are longer than any terminal's 80 columns
LONG_NAME = "a-model-with-a-rather-long-file-name-so-that-log-lines-run-past-eighty-columns.gguf"


def _load(server: ServeProcess, models_dir: Path, tmp_path: Path) -> dict[str, Any]:
    name = put(models_dir, write_fixture(tmp_path / "m.gguf", tensors=mixed_tensors(0)), LONG_NAME)
    with httpx.Client(base_url=server.url, timeout=30) as client:
        resp = client.post("/v1/loads", json={"model": name, "n_gpu_layers": "all"})
        assert resp.status_code == 202, resp.text
        job = wait_for(client, resp.headers["location"], ENDED)
        assert client.get("/nothing/here").status_code == 404
    assert job["state"] == "succeeded", job
    return job


def _output(server: ServeProcess, needle: str) -> str:
    """The server's output once ``needle`` was written (records of a request are written
    as its response goes)."""
    import time

    deadline = time.monotonic() + 10
    while needle not in (out := server.output()):
        assert time.monotonic() < deadline, out
        time.sleep(0.05)
    return out


def _time(text: str) -> datetime:
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", text), text
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def test_json_lines_carry_the_job_and_model(hoist_serve: Any, models_dir: Path, tmp_path: Path) -> None:
    server: ServeProcess = hoist_serve(
        args=["--log-level", "info"], HOIST_LOG_FORMAT="json", HOIST_EMULATED_DEVICES="EMU0=64MiB"
    )
    job = _load(server, models_dir, tmp_path)
    out = _output(server, "/nothing/here")
    records = [json.loads(line) for line in out.splitlines() if line.strip()]  # every line is one object
    for r in records:
        _time(r["time"])
        assert r["level"] in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL") and r["logger"] and "message" in r
    loggers = {r["logger"] for r in records}
    assert {"uvicorn.error", "uvicorn.access", "service.api.runner"} <= loggers, loggers

    of_job = [r for r in records if r.get("job_id") == job["id"]]
    assert of_job and all(r["model"] == LONG_NAME for r in of_job)
    messages = [r["message"] for r in of_job]
    # llama.cpp's lines as the job reports them, character for character
    report = job["memory"]["lines"]
    offload = [line for line in job["plan"]["lines"] if line.startswith("offload")]
    assert report and any(line.startswith("  ") for line in report)
    assert offload and messages[: len(offload)] == offload
    assert all(line in messages for line in report)
    assert any(m.startswith(f"loaded {LONG_NAME} as {job['id']}") for m in messages)
    # records of other work name no job
    assert all("job_id" not in r for r in records if r["logger"].startswith("uvicorn"))

    access = [r for r in records if r["logger"] == "uvicorn.access"]
    post = next(r for r in access if r["method"] == "POST")
    assert post["path"] == "/v1/loads" and post["status_code"] == 202
    assert any(r["path"] == "/nothing/here" and r["status_code"] == 404 for r in access)


LINE = re.compile(r"(\S+) (DEBUG|INFO|WARNING|ERROR|CRITICAL) +(\S+)(?: \[(\S+) (.*?)\])?: (.*)")


def test_text_lines_are_one_format_and_never_wrapped(hoist_serve: Any, models_dir: Path, tmp_path: Path) -> None:
    server: ServeProcess = hoist_serve(args=["--log-level", "info"], HOIST_EMULATED_DEVICES="EMU0=64MiB")
    job = _load(server, models_dir, tmp_path)
    # a model file whose name would end a line and forge the next one
    forged = "x\n2026-01-01T00:00:00.000Z INFO    forged: hello\x1b[31m.gguf"
    name = put(models_dir, write_fixture(tmp_path / "f.gguf", tensors=mixed_tensors(2)), forged)
    with httpx.Client(base_url=server.url, timeout=30) as client:
        resp = client.post("/v1/loads", json={"model": name, "name": "forged"})  # the path is no valid name
        assert wait_for(client, resp.headers["location"], ENDED)["state"] == "succeeded"
    out = _output(server, "forged")
    lines = out.splitlines()
    parsed = []
    for line in lines:
        match = LINE.fullmatch(line)
        assert match, f"not a log line (wrapped?): {line!r}"
        _time(match[1])
        parsed.append(match)
    assert max(len(line) for line in lines) > 120  # long lines stay whole
    assert {m[3] for m in parsed} >= {"uvicorn.error", "uvicorn.access", "service.api.runner"}
    of_job = [m for m in parsed if m[4] == job["id"]]
    assert of_job and all(m[5] == LONG_NAME for m in of_job)
    messages = [m[6] for m in of_job]
    assert all(line in messages for line in job["memory"]["lines"])
    assert not any(line.endswith(" ") for line in lines)  # no padding to a width
    assert not any(m[3] == "forged" for m in parsed)
    escaped = "x\\x0a2026-01-01T00:00:00.000Z INFO    forged: hello\\x1b[31m.gguf"
    assert any(m[6].startswith(f"loaded {escaped} as ") for m in parsed), out


def test_a_bad_log_format_is_a_usage_error(monkeypatch: pytest.MonkeyPatch, models_dir: Path) -> None:
    monkeypatch.setenv("HOIST_LOG_FORMAT", "xml")
    assert cli.main(["serve", "--models-dir", str(models_dir), "--port", "1"]) == cli.EXIT_USAGE


def test_the_cli_logs_plain_lines_off_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    handler = cli_handler(Console(file=io.StringIO(), width=80))
    assert isinstance(handler, StderrHandler)
    terminal = cli_handler(Console(file=io.StringIO(), force_terminal=True))
    assert not isinstance(terminal, StderrHandler)  # rich's, beside the progress bars
    logger = logging.getLogger("tests.cli_plain")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        message = "word " * 60
        logger.warning("%s", message)
    finally:
        logger.removeHandler(handler)
        logger.propagate = True
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.rstrip("\n").endswith(message)


def test_a_bound_load_tags_its_task_only() -> None:
    import asyncio

    records: list[logging.LogRecord] = []
    config = log_config("text", "info")
    assert config["root"]["handlers"] == ["stderr"]

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    keep = Keep()
    from service.logs import LoadContext

    keep.addFilter(LoadContext())
    logger = logging.getLogger("tests.bound")
    logger.addHandler(keep)
    logger.setLevel(logging.INFO)
    logger.propagate = False

    async def load() -> None:
        bind_load("lj_1", "m.gguf")
        logger.info("inside")
        await asyncio.to_thread(logger.info, "on a thread")
        logger.info("given", extra={"job_id": "lj_2", "model": "other.gguf"})

    async def main() -> None:
        await asyncio.create_task(load())
        logger.info("outside")

    try:
        asyncio.run(main())
    finally:
        logger.removeHandler(keep)
        logger.propagate = True
    got = [(r.getMessage(), getattr(r, "job_id", None), getattr(r, "model", None)) for r in records]
    assert got == [
        ("inside", "lj_1", "m.gguf"),
        ("on a thread", "lj_1", "m.gguf"),
        ("given", "lj_2", "other.gguf"),
        ("outside", None, None),
    ]
    text = TextFormatter().format(records[0])
    assert re.fullmatch(r"\S+Z INFO    tests\.bound \[lj_1 m\.gguf\]: inside", text), text
