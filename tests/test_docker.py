"""The Dockerfile, .dockerignore and compose file carry what a container deployment needs.
No Docker engine runs here, so the Dockerfile is read with a Dockerfile parser, the build
context is computed with Docker's own .dockerignore rules (docker-py), the compose file is
validated against the Compose Specification's schema, and the health checks are run
against a real server."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from docker.utils.build import exclude_paths
from dockerfile_parse import DockerfileParser

ROOT = Path(__file__).resolve().parent.parent
Instruction = tuple[str, str]


def parser(build_args: dict[str, str] | None = None) -> DockerfileParser:
    return DockerfileParser(str(ROOT / "Dockerfile"), env_replace=False, build_args=build_args or {})


def stages() -> list[list[Instruction]]:
    """The instructions of each build stage (FROM first), comments left out."""
    out: list[list[Instruction]] = []
    for item in parser().structure:
        word, value = item["instruction"], " ".join(item["value"].split())
        if word == "FROM":
            out.append([])
        if word != "COMMENT" and out:
            out[-1].append((word, value))
    return out


def runtime_stage() -> list[Instruction]:
    """The last stage: the image `docker build .` makes."""
    return stages()[-1]


def image_user() -> tuple[int, int]:
    """(uid, gid) of the final USER instruction, which must be numeric."""
    user = [v for w, v in runtime_stage() if w == "USER"][-1]
    uid, _, gid = user.partition(":")
    return int(uid), int(gid)


def env_of(stage: list[Instruction]) -> dict[str, str]:
    out: dict[str, str] = {}
    for word, value in stage:
        if word == "ENV":
            for pair in shlex.split(value):
                key, _, val = pair.partition("=")
                out[key] = val
    return out


def constraints_python() -> str:
    match = re.search(r"^# python_version: (\S+)$", (ROOT / "constraints.txt").read_text(), re.M)
    assert match, "constraints.txt names the Python version it was written for"
    return match.group(1)


def compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return doc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# ---- Dockerfile


def test_the_image_is_built_in_two_stages_on_the_constraints_python() -> None:
    all_stages = stages()
    assert parser().is_multistage and len(all_stages) >= 2
    build, runtime = all_stages[0], all_stages[-1]
    assert build[0][1].endswith(" AS build")
    # the runtime stage takes the environment, and installs nothing itself
    assert ("COPY", "--from=build /opt/hoist /opt/hoist") in runtime
    assert not any("pip" in value for word, value in runtime if word == "RUN")
    # the default base image runs the Python the pins were made for
    (base,) = set(parser().parent_images)
    match = re.fullmatch(r"python:(\d+\.\d+)-slim(-\w+)?", base)
    assert match and match.group(1) == constraints_python()


def test_dependencies_are_installed_from_the_constraints() -> None:
    build = stages()[0]
    installs = [(i, v) for i, (w, v) in enumerate(build) if w == "RUN" and "pip install" in v]
    assert installs
    for _, value in installs:
        for command in value.split("&&"):
            if "pip install" in command:
                args = shlex.split(command)
                assert ("-c" in args and args[args.index("-c") + 1] == "constraints.txt") or "--no-deps" in args
    copied = next(i for i, (w, v) in enumerate(build) if w == "COPY" and "constraints.txt" in v.split())
    assert copied < installs[0][0]


@pytest.mark.parametrize(("extras", "target"), [("", "."), ("cuda", ".[cuda]")])
def test_the_cuda_variant_installs_the_cuda_extra(extras: str, target: str) -> None:
    """HOIST_EXTRAS=cuda selects pyproject's `cuda` extra; the shell of the RUN line expands it."""
    (value,) = [v for w, v in stages()[0] if w == "RUN" and "-c constraints.txt" in v]
    (command,) = [c for c in value.split("&&") if "pip install" in c]
    word = shlex.split(command)[-1]
    run = subprocess.run(
        ["sh", "-c", f'printf %s "{word}"'], env={"HOIST_EXTRAS": extras}, capture_output=True, text=True, check=True
    )
    assert run.stdout == target
    extras_declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "cuda" in extras_declared
    # PyTorch stays the base image's: the venv sees the system's site packages
    assert any(w == "RUN" and "venv --system-site-packages /opt/hoist" in v for w, v in stages()[0])


def test_the_image_runs_unprivileged_on_a_read_only_root() -> None:
    runtime = runtime_stage()
    uid, gid = image_user()
    assert uid >= 1000 and gid >= 1000
    (useradd,) = [v for w, v in runtime if w == "RUN" and "useradd" in v]
    assert f"--uid {uid}" in useradd and f"--gid {gid}" in useradd
    env = env_of(runtime)
    # nothing is written outside /tmp: no bytecode, and HOME and the caches are there
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"
    for key in ("HOME", "XDG_CACHE_HOME", "CUDA_CACHE_PATH"):
        assert Path(env[key]).is_relative_to("/tmp"), key
    assert env["HOIST_MODELS_DIR"] == "/models"
    assert any(w == "VOLUME" and "/models" in json.loads(v) for w, v in runtime)


def test_no_secret_is_built_into_the_image() -> None:
    secret = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY|CREDENTIAL", re.I)
    for stage in stages():
        for key in env_of(stage):
            assert not secret.search(key), key
        for word, value in stage:
            if word == "ARG":
                assert not secret.search(value.split("=")[0]), value
            if word in ("COPY", "ADD"):
                assert not secret.search(value) and ".env" not in value.split(), value


def test_the_command_serves_on_the_exposed_port() -> None:
    runtime = runtime_stage()
    (cmd,) = [json.loads(v) for w, v in runtime if w == "CMD"]
    assert cmd[:2] == ["hoist", "serve"]
    host, port = cmd[cmd.index("--host") + 1], cmd[cmd.index("--port") + 1]
    assert host == "0.0.0.0"
    assert [v for w, v in runtime if w == "EXPOSE"] == [port]
    (health,) = [v for w, v in runtime if w == "HEALTHCHECK"]
    assert f"http://127.0.0.1:{port}/healthz" in health


def healthcheck_commands() -> dict[str, list[str]]:
    (health,) = [v for w, v in runtime_stage() if w == "HEALTHCHECK"]
    image = json.loads(health[health.index("CMD ") + 4 :])
    test = compose()["x-hoist"]["healthcheck"]["test"]
    assert test[0] == "CMD"
    return {"image": image, "compose": test[1:]}


def test_the_health_checks_pass_against_a_serving_hoist_and_fail_without_one(tmp_path: Path) -> None:
    """Both checks are run as written, on another port, against `hoist serve` configured as
    in the container (a token from a file, every other setting default)."""
    port = free_port()
    commands = {
        name: [sys.executable if a == "python" else a.replace(":8000/", f":{port}/") for a in argv]
        for name, argv in healthcheck_commands().items()
    }
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOIST_")}
    env |= {"HOIST_MODELS_DIR": str(tmp_path), "HOIST_API_TOKEN_FILE": str(token), "HOIST_CUDA": "false"}
    for argv in commands.values():
        assert subprocess.run(argv, capture_output=True, timeout=30).returncode != 0
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-c", "import sys; from service.cli import main; sys.exit(main())"]
            + ["serve", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while subprocess.run(commands["image"], capture_output=True, timeout=30).returncode != 0:
            assert server.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "hoist serve did not answer /healthz"
            time.sleep(0.2)
        for name, argv in commands.items():
            assert subprocess.run(argv, capture_output=True, timeout=30).returncode == 0, name
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_the_container_command_refuses_to_serve_without_a_token(tmp_path: Path) -> None:
    (cmd,) = [json.loads(v) for w, v in runtime_stage() if w == "CMD"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOIST_")}
    env["HOIST_MODELS_DIR"] = str(tmp_path)
    run = subprocess.run(
        [sys.executable, "-c", "import sys; from service.cli import main; sys.exit(main())", *cmd[1:]],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=ROOT,
    )
    assert run.returncode == 1 and "without an API token" in run.stderr


# ---- build context


def context(root: Path) -> set[str]:
    """The paths a docker client sends for ``root``, by Docker's .dockerignore rules."""
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    return set(exclude_paths(str(root), patterns, dockerfile="Dockerfile"))


def test_the_build_context_holds_what_the_build_copies_and_nothing_heavy(tmp_path: Path) -> None:
    present = [
        "pyproject.toml",
        "README.md",
        "constraints.txt",
        "Dockerfile",
        "service/__init__.py",
        "service/api/app.py",
        "service/loader/plan.py",
    ]
    absent = [
        ".venv/lib/python3.11/site-packages/numpy/__init__.py",
        "models/gemma-3-270m-q4_k_m.gguf",
        ".git/HEAD",
        ".env",
        "secrets/hoist-api-token",
        "tests/test_docker.py",
        "tests/data/oracle_configs.json",
        "bench/load.py",
        "bench-results.json",
        ".pytest_cache/v/cache/nodeids",
        ".mypy_cache/3.11/x.json",
        ".ruff_cache/x",
        ".hypothesis/examples/x",
        "service/__pycache__/__init__.cpython-311.pyc",
        "service/api/__pycache__/app.cpython-311.pyc",
        "hoist.egg-info/PKG-INFO",
        "build/lib/service/__init__.py",
        "dist/hoist-0.1.0.whl",
        "deploy/kubernetes/base/deployment.yaml",
        "docker-compose.yml",
    ]
    for rel in present + absent:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    kept = {p for p in context(tmp_path) if (tmp_path / p).is_file()}
    assert kept == set(present)


def test_every_file_the_dockerfile_copies_is_in_the_context() -> None:
    kept = context(ROOT)
    for stage in stages():
        for word, value in stage:
            if word in ("COPY", "ADD") and not value.startswith("--from"):
                *sources, _ = value.split()
                for source in sources:
                    assert source in kept, source
    python_files = {str(p.relative_to(ROOT)) for p in (ROOT / "service").rglob("*.py")}
    assert python_files and python_files <= kept


# ---- compose


def check_compose_schema(path: Path) -> subprocess.CompletedProcess[str]:
    """check-jsonschema with the Compose Specification schema it ships (no network)."""
    return subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_compose_file_is_valid_against_the_compose_specification(tmp_path: Path) -> None:
    run = check_compose_schema(ROOT / "docker-compose.yml")
    assert run.returncode == 0, run.stdout + run.stderr
    # the schema catches a mistake: a GPU reservation whose capabilities are not a list
    broken = (ROOT / "docker-compose.yml").read_text().replace("capabilities: [gpu]", "capabilities: gpu")
    assert broken != (ROOT / "docker-compose.yml").read_text()
    (tmp_path / "docker-compose.yml").write_text(broken)
    run = check_compose_schema(tmp_path / "docker-compose.yml")
    assert run.returncode == 1 and "capabilities" in run.stdout + run.stderr


@pytest.mark.parametrize("name", ["hoist", "hoist-gpu"])
def test_each_service_is_confined_and_takes_its_token_from_a_secret(name: str) -> None:
    doc = compose()
    service = doc["services"][name]
    assert service["build"]
    assert any(str(p).endswith(":8000") for p in service["ports"])
    assert any(str(v).endswith(":/models:ro") for v in service["volumes"])
    check = service["healthcheck"]
    assert "/healthz" in " ".join(check["test"]) and check["interval"]
    env = service["environment"]
    assert env["HOIST_MODELS_DIR"] == "/models"
    # the token is a file from a compose secret, never a variable of the container
    assert "HOIST_API_TOKEN" not in env
    (secret,) = service["secrets"]
    assert env["HOIST_API_TOKEN_FILE"] == f"/run/secrets/{secret}"
    assert doc["secrets"][secret] == {"environment": "HOIST_API_TOKEN"}
    # served on every address of the container: memory bounded, nothing writable but /tmp
    assert service["mem_limit"] and service["memswap_limit"] == service["mem_limit"]
    assert service["read_only"] is True and service["tmpfs"] == ["/tmp"]
    assert "ALL" in service["cap_drop"] and "cap_add" not in service
    assert service["ulimits"]["memlock"] == -1
    # HOIST_PRELOAD is passed on from where compose runs, unset otherwise
    assert "HOIST_PRELOAD" in env and env["HOIST_PRELOAD"] is None


def test_the_gpu_profile_reserves_a_gpu_for_the_cuda_image() -> None:
    services = compose()["services"]
    cpu, gpu = services["hoist"], services["hoist-gpu"]
    assert "profiles" not in cpu and gpu["profiles"] == ["gpu"]
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["capabilities"] == ["gpu"] and device["count"] == 1 and device["driver"] == "nvidia"
    assert "deploy" not in cpu
    args = gpu["build"]["args"]
    assert args["HOIST_EXTRAS"] == "cuda"
    base = re.fullmatch(r"\$\{HOIST_CUDA_BASE_IMAGE:-(.+)\}", args["BASE_IMAGE"])
    assert base and re.match(r"(pytorch/pytorch|nvidia/cuda):", base.group(1))
    assert set(parser(build_args={"BASE_IMAGE": base.group(1)}).parent_images) == {base.group(1)}
    assert gpu["image"] != cpu["image"]
    # both may run at once: their default host ports differ
    (cpu_port,) = [re.fullmatch(r"\$\{\w+:-(\d+)\}:8000", p) for p in cpu["ports"]]
    (gpu_port,) = [re.fullmatch(r"\$\{\w+:-(\d+)\}:8000", p) for p in gpu["ports"]]
    assert cpu_port and gpu_port and cpu_port.group(1) != gpu_port.group(1)
