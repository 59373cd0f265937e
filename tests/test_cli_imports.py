"""What the ``hoist`` command imports: ``--help`` and ``inspect`` leave the service, the
loader's pipeline and planner, and the heavy libraries alone (checked in fresh
interpreters, through ``sys.modules``; the time this saves is shown by bench/startup.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import Fixture

ROOT = Path(__file__).resolve().parent.parent

_REPORT = """
import json, sys
{prelude}
from service.cli import main
try:
    status = main(sys.argv[1:])
except SystemExit as exc:
    status = exc.code
sys.stdout.flush()
sys.stderr.write("\\nMODULES " + json.dumps(sorted(sys.modules)) + "\\n")
"""

# never needed to print help or a header's contents
SERVICE_LIBRARIES = {"fastapi", "starlette", "uvicorn", "pydantic", "pydantic_settings", "httpx", "prometheus_client"}
HEAVY = {"numpy", "gguf", "rich", "regex", "yaml", "uvloop"}


def modules_after(*argv: str, prelude: str = "") -> set[str]:
    """The modules a fresh interpreter holds after running ``hoist argv`` (``prelude``
    first)."""
    result = subprocess.run(
        [sys.executable, "-c", _REPORT.format(prelude=prelude), *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    line = next(x for x in result.stderr.splitlines() if x.startswith("MODULES "))
    return set(json.loads(line.removeprefix("MODULES ")))


def top_level(modules: set[str]) -> set[str]:
    return {m.split(".")[0] for m in modules}


@pytest.mark.parametrize("argv", [["--help"], ["inspect", "--help"], ["serve", "--help"], ["--version"]])
def test_help_imports_no_library_of_the_service(argv: list[str]) -> None:
    modules = modules_after(*argv)
    assert "service.cli.parser" in modules  # the report ran after the parser
    assert not top_level(modules) & (SERVICE_LIBRARIES | HEAVY)
    assert not {m for m in modules if m.startswith(("service.api", "service.loader.pipeline", "service.io"))}


def test_inspect_reads_a_header_without_the_service_or_the_pipeline(all_types_fixture: Fixture) -> None:
    modules = modules_after("inspect", str(all_types_fixture.path))
    assert "service.loader.gguf.reader" in modules and "service.loader.summary" in modules
    # no array here is long enough for the vectorised scan, so not even numpy is needed
    assert not top_level(modules) & (SERVICE_LIBRARIES | HEAVY)
    assert not {m for m in modules if m.startswith(("service.api", "service.loader.pipeline", "service.io.align"))}
    assert "service.loader.placement.plan" not in modules


def test_inspect_of_a_model_with_a_vocabulary_imports_numpy_only_when_worth_it(tmp_path: Path) -> None:
    """A vocabulary shorter than what importing numpy costs to walk is walked; a longer
    one is scanned with numpy (the limit lowered here to keep the file small)."""
    import gguf

    path = tmp_path / "vocab.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(10_000)])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    walked = top_level(modules_after("inspect", str(path)))
    assert not walked & (SERVICE_LIBRARIES | HEAVY)
    lowered = "import service.loader.gguf.reader as r; r._IMPORT_WORTH_STRINGS = 5000"
    scanned = top_level(modules_after("inspect", str(path), prelude=lowered))
    assert "numpy" in scanned  # the vocabulary was scanned vectorised
    assert not scanned & (SERVICE_LIBRARIES | {"gguf", "rich", "regex"})


def test_parser_defaults_are_the_loaders() -> None:
    """The parser states the pipeline's default without importing it: the two agree."""
    from service.cli import parse_args
    from service.loader import pipeline

    assert parse_args(["load", "m.gguf"]).staging_buffers == pipeline.DEFAULT_STAGING_BUFFERS
