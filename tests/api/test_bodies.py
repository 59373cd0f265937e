"""Bodies that cannot be parsed, whatever the reason, are a 422 ``validation_error``
problem naming what is wrong, answered quickly, and the service stays up."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.api.test_hostile import is_problem

JSON = {"content-type": "application/json"}
DEPTH = 100_000


def _deep(opening: str, closing: str) -> bytes:
    return (opening * DEPTH + closing * DEPTH).encode()


def _json_error(text: bytes) -> type[Exception]:
    """The exception Python's own ``json.loads`` raises for ``text``: the cross-check that
    the body is one the standard parser refuses, and why."""
    try:
        json.loads(text)
    except Exception as exc:
        return type(exc)
    raise AssertionError("the body parses")


BODIES = {
    "invalid UTF-8 in a string": (b'{"model": "\xff"}', UnicodeDecodeError, "UTF-8"),
    "invalid UTF-8 outside strings": (b'{"model": "m.gguf"\xc3}', UnicodeDecodeError, "UTF-8"),
    "an integer of 5000 digits": (b'{"model": "m.gguf", "main_gpu": ' + b"9" * 5000 + b"}", ValueError, "digits"),
    "arrays nested 100,000 deep": (_deep("[", "]"), RecursionError, "deep"),
    "objects nested 100,000 deep": (_deep('{"a":', "}").replace(b"}", b"1}", 1), RecursionError, "deep"),
    "truncated JSON": (b'{"model": "m.g', json.JSONDecodeError, "JSON"),
}


@pytest.mark.parametrize("route", ["/v1/plans", "/v1/loads"])
@pytest.mark.parametrize("case", list(BODIES))
def test_a_body_that_cannot_be_parsed_is_a_validation_error(live_server: str, route: str, case: str) -> None:
    body, expected, word = BODIES[case]
    assert issubclass(_json_error(body), expected)
    with httpx.Client(base_url=live_server, timeout=30) as client:
        start = time.monotonic()
        problem = is_problem(client.post(route, content=body, headers=JSON), 422, "validation_error")
        assert time.monotonic() - start < 2
        assert word in problem["detail"], problem
        assert problem["errors"] and problem["errors"][0]["loc"][0] == "body"
        assert client.get("/healthz").status_code == 200


def test_a_deep_value_the_parser_takes_is_refused_by_the_schema(live_server: str) -> None:
    body = b'{"model": "m.gguf", "tensor_split": ' + b"[" * 200 + b"]" * 200 + b"}"
    with httpx.Client(base_url=live_server, timeout=30) as client:
        problem = is_problem(client.post("/v1/plans", content=body, headers=JSON), 422, "validation_error")
        assert "tensor_split" in problem["detail"]
