"""Property-based requests generated from the OpenAPI schema (schemathesis), against the
real service with and without a bearer token: no 5xx, every error a problem+json with a
stable code, every documented response as documented."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.config import SchemathesisConfig

from service.api.app import create_app
from service.api.settings import Settings
from tests.conftest import _serve
from tests.helpers import mixed_tensors, write_fixture

TOKEN = "schema-test-token"


def _openapi() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        return create_app(Settings(models_dir=Path(d), cuda=False)).openapi()


# a body too large for the service is refused with 413, another way to reject bad data;
# valid bodies may still name a path or flags the service refuses (400), a file that is
# not GGUF (422), or need memory that is taken (409)
_CONFIG = SchemathesisConfig.from_dict(
    {
        "checks": {
            "negative_data_rejection": {"expected-statuses": ["400", "401", "404", "405", "409", "413", "422"]},
            "positive_data_acceptance": {"expected-statuses": ["2XX", "400", "401", "404", "409", "422", "429"]},
        }
    }
)
schema = schemathesis.openapi.from_dict(_openapi(), config=_CONFIG)


def _models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("models")
    write_fixture(d / "m.gguf", tensors=mixed_tensors(0))
    return d


@pytest.fixture(scope="module")
def open_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from _serve(Settings(models_dir=_models(tmp_path_factory), cuda=False, emulated_devices="EMU0=64MiB"))


@pytest.fixture(scope="module")
def token_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from _serve(Settings(models_dir=_models(tmp_path_factory), cuda=False, api_token=TOKEN))


def _header(response: Any, name: str) -> str:
    value = response.headers.get(name, [""])
    return str(value[0] if isinstance(value, list) else value)


@schemathesis.check
def errors_are_problems(ctx: Any, response: Any, case: Any) -> bool | None:
    """Every 4xx and 5xx answer is an RFC 9457 problem with a code."""
    if response.status_code < 400:
        return None
    content_type = _header(response, "content-type")
    if not content_type.startswith("application/problem+json"):
        raise AssertionError(f"{response.status_code} answered as {content_type!r}")
    body = response.json()
    if not (body.get("status") == response.status_code and body.get("code") and body.get("detail")):
        raise AssertionError(f"not a problem: {body}")
    return None


SETTINGS = settings(
    max_examples=int(os.environ.get("HOIST_SCHEMA_EXAMPLES", "25")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture],
)


@schema.parametrize()
@SETTINGS
def test_without_a_token(case: schemathesis.Case, open_server: str) -> None:
    case.call_and_validate(base_url=open_server, additional_checks=[errors_are_problems])


@schema.parametrize()
@SETTINGS
def test_with_a_token(case: schemathesis.Case, token_server: str) -> None:
    case.call_and_validate(
        base_url=token_server, headers={"Authorization": f"Bearer {TOKEN}"}, additional_checks=[errors_are_problems]
    )


@schema.parametrize()
@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
def test_a_missing_token_is_always_401(case: schemathesis.Case, token_server: str) -> None:
    response = case.call(base_url=token_server)
    if case.path in ("/healthz", "/readyz"):  # the probes are open (no preload: ready)
        assert response.status_code == (200 if case.method.upper() in ("GET", "HEAD") else 405)
    else:
        assert response.status_code == 401, response.text
        assert _header(response, "content-type").startswith("application/problem+json")
        assert _header(response, "www-authenticate").startswith("Bearer")
