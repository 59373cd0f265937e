"""The Dockerfile and compose file carry what a container deployment needs (no Docker
engine runs here, so their content is checked)."""

from __future__ import annotations

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
