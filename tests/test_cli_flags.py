"""The command line takes llama.cpp's habits: ``-m/--model``, its former load switches,
``-ngl`` as llama.cpp parses it; it guesses no abbreviation, labels each load mode one
way, and says with its exit status whether a plan fits."""

from __future__ import annotations

import argparse
import errno
import json
import subprocess
import sys
from pathlib import Path

import pytest

from service import cli
from service.api.schemas import PlanRequest
from service.loader.placement import LazyMode, LoadMode, SplitMode
from tests.helpers import block_model

EMU = "EMU0=1GiB,EMU1=1GiB"


def hoist(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service.cli", *args], capture_output=True, text=True, timeout=120, check=False
    )


def usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The argparse error line of ``argv`` (which must be a usage error, status 2)."""
    with pytest.raises(SystemExit) as info:
        cli.parse_args(argv)
    assert info.value.code == cli.EXIT_USAGE
    return capsys.readouterr().err.splitlines()[-1]


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return block_model(tmp_path / "m.gguf", 8, elements=1024)


# -- -m/--model ---------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["inspect", "plan", "load"])
def test_the_model_path_is_positional_or_dash_m(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.parse_args([command, "models/x.gguf"]).model == "models/x.gguf"
    assert cli.parse_args([command, "-m", "models/x.gguf"]).model == "models/x.gguf"
    assert cli.parse_args([command, "--model", "models/x.gguf"]).model == "models/x.gguf"
    assert cli.parse_args([command, "--model=models/x.gguf"]).model == "models/x.gguf"
    assert "not allowed with" in usage_error([command, "-m", "a.gguf", "b.gguf"], capsys)
    assert "required" in usage_error([command], capsys)


def test_load_dash_m_loads(model: Path) -> None:
    result = hoist("load", "-m", str(model), "--no-cuda", "-ngl", "3", "-mg", "0")
    assert result.returncode == 0, result.stderr
    assert "model buffer size" in result.stdout


# -- no abbreviations ------------------------------------------------------------------------


def _parsers() -> list[argparse.ArgumentParser]:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [parser, *sub.choices.values()]


def test_every_parser_refuses_abbreviations() -> None:
    parsers = _parsers()
    assert len(parsers) == 9
    assert all(p.allow_abbrev is False and isinstance(p, cli.Parser) for p in parsers)


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "m.gguf", "-n", "5"],  # not -ngl
        ["plan", "m.gguf", "-ng", "5"],
        ["load", "m.gguf", "-s", "row"],  # not -sm
        ["plan", "m.gguf", "--no-h"],  # not --no-host
        ["plan", "m.gguf", "--emulated", "EMU0=1GiB"],
        ["load", "m.gguf", "--check"],
        ["plan", "m.gguf", "-mg1"],  # no value glued to an option name
        ["serve", "--allow"],
        ["devices", "--js"],
        ["demo", "--mod", "d"],
        ["watch", "lj_1", "--ur", "http://x"],  # not --url
        ["--vers", "devices"],
    ],
)
def test_abbreviations_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert "unrecognized arguments" in usage_error(argv, capsys)


def test_exact_spellings_still_parse() -> None:
    args = cli.parse_args(["plan", "m.gguf", "-ngl=5", "-mg", "1", "-sm", "none", "--no-host"])
    assert (args.n_gpu_layers, args.main_gpu, args.split_mode, args.no_host) == ("5", 1, "none", True)
    assert cli.parse_args(["plan", "m.gguf", "-ngl", "-5"]).n_gpu_layers == "-5"  # a value, not an option


# -- llama.cpp's former load switches ------------------------------------------------------------

# use_mmap was on by default and --mlock added use_mlock; llama-cpp-python 0.3.36 (the
# binding of this llama.cpp) turns the pair into a load mode: both -> MMAP_MLOCK, mlock
# alone -> MLOCK, mmap alone -> MMAP, neither -> NONE; direct I/O took precedence over mmap
SWITCHES = [
    (["--no-mmap"], "none"),
    (["--mmap"], "mmap"),
    (["--mlock"], "mmap+mlock"),
    (["--no-mmap", "--mlock"], "mlock"),
    (["--mlock", "--no-mmap"], "mlock"),
    (["--mmap", "--no-mmap"], "none"),  # the last of a pair wins
    (["--no-mmap", "--mmap", "--mlock"], "mmap+mlock"),
    (["-dio"], "direct-io"),
    (["--direct-io", "--no-mmap", "--mlock"], "direct-io"),
]


@pytest.mark.parametrize(("switches", "mode"), SWITCHES)
def test_former_switches_stand_for_load_modes(
    switches: list[str], mode: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for command in ("plan", "load", "demo"):
        path = [] if command == "demo" else ["m.gguf"]
        assert cli.parse_args([command, *path, *switches]).load_mode == mode
        note = capsys.readouterr().err.strip()
        assert note.startswith("note: ") and note.endswith(f"taken as -lm {mode}") and "\n" not in note


def test_former_switches_with_dash_lm_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    line = usage_error(["load", "m.gguf", "--no-mmap", "-lm", "mmap"], capsys)
    assert "-lm cannot be combined with --no-mmap: use -lm none alone" in line


def test_without_switches_the_load_mode_is_dash_lm(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.parse_args(["plan", "m.gguf"]).load_mode == "auto"
    assert cli.parse_args(["plan", "m.gguf", "-lm", "dio"]).load_mode == "dio"
    assert capsys.readouterr().err == ""


def test_a_former_switch_loads_end_to_end(model: Path) -> None:
    result = hoist("load", str(model), "--no-cuda", "--no-mmap")
    assert result.returncode == 0, result.stderr
    assert "note: --no-mmap taken as -lm none" in result.stderr
    assert "load mode: none" in result.stderr and "CPU model buffer size" in result.stdout


# -- one spelling list per flag --------------------------------------------------------------


def test_cli_choices_are_the_api_enums() -> None:
    schema = PlanRequest.model_json_schema()["properties"]
    place = next(p for p in _parsers() if p.prog.endswith(" plan"))
    choices = {a.dest: a.choices for a in place._actions if a.choices}
    for field, enum in (("split_mode", SplitMode), ("load_mode", LoadMode), ("lazy_mode", LazyMode)):
        assert list(choices[field]) == schema[field]["enum"] == list(enum.spellings())
    assert "dio" in schema["load_mode"]["enum"]
    demo = next(p for p in _parsers() if p.prog.endswith(" demo"))
    assert next(a.choices for a in demo._actions if a.dest == "load_mode") == LoadMode.spellings()


# -- -ngl edge values ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "offloaded"),
    [
        ("auto", 9),  # llama.cpp stores -1; the loader reads a negative count as n_layer + 1
        ("all", 9),  # stored as -2; the same
        ("-1", 9),  # std::stoi gives -1: the same as auto
        ("-5", 9),  # std::stoi gives -5; negative: every layer
        ("-2147483648", 9),  # INT_MIN fits std::stoi; negative
        ("0", 0),
        ("+3", 3),  # std::stoi takes a sign
        ("003", 3),
        ("9", 9),
        ("2147483647", 9),  # INT_MAX fits std::stoi; the loader takes min(n, n_layer + 1)
    ],
)
def test_ngl_values_llama_cpp_accepts(model: Path, value: str, offloaded: int) -> None:
    result = hoist("plan", str(model), "--no-cuda", "--emulated-devices", EMU, "--json", "-ngl", value)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["offload_lines"][-1] == f"offloaded {offloaded}/9 layers to GPU"
    assert sum(dev != "CPU" for dev in data["layers"].values()) == offloaded


@pytest.mark.parametrize(
    "value",
    [
        "2147483648",  # std::stoi: out_of_range
        "-2147483649",  # the same
        "99999999999999999999",
        "abc",  # std::stoi: invalid_argument
        "ALL",  # llama.cpp compares the words exactly
        "1.5",  # std::stoi would stop at '.', reading 1: hoist refuses rather than guesses
        "1e3",  # likewise (std::stoi: 1)
        "0x10",  # likewise (std::stoi: 0)
        " 5",  # std::stoi skips the blank; hoist refuses
    ],
)
def test_ngl_values_refused_on_one_line(model: Path, value: str) -> None:
    result = hoist("plan", str(model), "--no-cuda", f"-ngl={value}")
    assert result.returncode == cli.EXIT_ERROR
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hoist: error: invalid n_gpu_layers"), result.stderr
    assert "'all' or 'auto'" in lines[0]


def test_an_empty_ngl_is_refused(model: Path) -> None:
    result = hoist("plan", str(model), "--no-cuda", "-ngl", "")  # std::stoi: invalid_argument
    assert result.returncode == cli.EXIT_ERROR and result.stderr.startswith("hoist: error: invalid n_gpu_layers ''")


# -- exit codes ---------------------------------------------------------------------------


@pytest.mark.parametrize("json_output", [False, True])
def test_plan_exit_status_says_whether_it_fits(model: Path, json_output: bool) -> None:
    extra = ["--json"] if json_output else []
    fits = hoist("plan", str(model), "--no-cuda", "--emulated-devices", "EMU0=1GiB", *extra)
    assert fits.returncode == cli.EXIT_OK, fits.stderr
    tight = hoist("plan", str(model), "--no-cuda", "--emulated-devices", "EMU0=8KiB", *extra)
    assert tight.returncode == cli.EXIT_DOES_NOT_FIT == 3, tight.stderr
    if json_output:
        assert json.loads(tight.stdout)["fits"] is False
    else:
        assert "EMU0:" in tight.stderr and "DOES NOT FIT" in tight.stderr


def test_a_load_that_does_not_fit_exits_with_the_same_status(model: Path) -> None:
    result = hoist("load", str(model), "--no-cuda", "--emulated-devices", "EMU0=8KiB")
    assert result.returncode == cli.EXIT_DOES_NOT_FIT
    assert "the model does not fit" in result.stderr


# -- load mode labels, warnings once -------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "label"),
    [("auto", "auto -> mmap"), ("none", "none"), ("dio", "direct-io"), ("mmap+mlock", "mmap+mlock")],
)
def test_each_load_mode_has_one_label(model: Path, flag: str, label: str) -> None:
    result = hoist("load", str(model), "--no-cuda", "-lm", flag)
    assert result.returncode == 0, result.stderr
    assert f"load mode: {label}\n" in result.stderr
    loaded = next(line for line in result.stderr.splitlines() if line.startswith("loaded "))
    assert loaded.endswith(" s") and result.stderr.count("load mode") == 1  # said once, one way
    planned = hoist("plan", str(model), "--no-cuda", "-lm", flag)
    assert f"load mode: {label}\n" in planned.stderr


def test_an_mlock_failure_is_reported_once(
    model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    from service.io import libc

    def refuse(addr: int, length: int) -> None:
        raise OSError(errno.ENOMEM, "refused")

    monkeypatch.setattr(libc, "mlock", refuse)
    monkeypatch.setattr(libc, "mlock_on_fault", refuse)
    for mode in ("mlock", "mmap+mlock"):
        assert cli.main(["load", str(model), "--no-cuda", "-lm", mode]) == 0
        err = capsys.readouterr().err
        assert err.count("failed to mlock") == 1, err
        assert not any("failed to mlock" in r.getMessage() for r in caplog.records)
