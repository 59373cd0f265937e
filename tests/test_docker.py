"""The Dockerfile and compose file carry what a container deployment needs (no Docker
engine runs here, so their content is checked)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_essentials() -> None:
    ins = dockerfile_instructions()
    froms = [rest for word, rest in ins if word == "FROM"]
    assert froms and all("python:3." in f and "slim" in f for f in froms)
    users = [rest for word, rest in ins if word == "USER"]
    assert users and users[-1] not in ("root", "0")
    assert any(word == "VOLUME" and "/models" in rest for word, rest in ins)
    health = [rest for word, rest in ins if word == "HEALTHCHECK"]
    assert health and "/healthz" in health[0]
    assert any(word == "EXPOSE" for word, _ in ins)
    cmd = " ".join(rest for word, rest in ins if word in ("CMD", "ENTRYPOINT"))
    assert "serve" in cmd and "0.0.0.0" in cmd
    env = " ".join(rest for word, rest in ins if word == "ENV")
    assert "HOIST_MODELS_DIR" in env


def test_compose_essentials() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    service = compose["services"]["hoist"]
    assert service["build"]
    assert any(str(p).endswith(":8000") for p in service["ports"])
    assert any("/models" in str(v) for v in service["volumes"])
    check = service["healthcheck"]
    assert "/healthz" in " ".join(check["test"]) and check["interval"]
    assert service["environment"]["HOIST_MODELS_DIR"] == "/models"
    # served on every address of the container: a token is required, and memory bounded
    assert service["environment"]["HOIST_API_TOKEN"].startswith("${HOIST_API_TOKEN:?")
    assert service["mem_limit"] and service["memswap_limit"] == service["mem_limit"]
    assert service["read_only"] is True and "ALL" in service["cap_drop"]


def test_the_container_command_refuses_to_serve_without_a_token(tmp_path: Path) -> None:
    import subprocess
    import sys

    cmd = next(rest for word, rest in reversed(dockerfile_instructions()) if word == "CMD")
    argv = json.loads(cmd)
    assert argv[:2] == ["hoist", "serve"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOIST_")}
    env["HOIST_MODELS_DIR"] = str(tmp_path)
    run = subprocess.run(
        [sys.executable, "-c", "import sys; from service.cli import main; sys.exit(main())", *argv[1:]],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=ROOT,
    )
    assert run.returncode == 1 and "without an API token" in run.stderr
