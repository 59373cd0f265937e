"""``/docs`` and ``/redoc`` render from assets the service serves itself: the pages name
no other host, and every asset they name is served."""

from __future__ import annotations

import re
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest

from service.api.settings import Settings
from tests.conftest import _serve


class _Urls(HTMLParser):
    """Every ``src``, ``href`` and ``spec-url`` attribute of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.urls += [v for k, v in attrs if k in ("src", "href", "spec-url") and v is not None]


def _page_urls(html: str) -> list[str]:
    parser = _Urls()
    parser.feed(html)
    # Swagger UI's configuration names the schema in a script
    return parser.urls + re.findall(r"url: '([^']*)'", html)


@pytest.mark.parametrize(("page", "assets"), [("/docs", 3), ("/redoc", 2)])
def test_docs_pages_use_local_assets_only(live_server: str, page: str, assets: int) -> None:
    with httpx.Client(base_url=live_server, timeout=30) as client:
        resp = client.get(page)
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/html")
        html = resp.text
        assert "http://" not in html and "https://" not in html and "//cdn" not in html, html
        urls = _page_urls(html)
        assert "/openapi.json" in urls
        assert len(urls) == assets + 1, urls  # the assets and the schema
        for url in urls:
            assert url.startswith("/") and not url.startswith("//"), url
            got = client.get(url)
            assert got.status_code == 200, url
            assert len(got.content) > 1000, url
        if page == "/docs":
            assert '"validatorUrl": null' in html  # no badge fetched from an online validator
        scripts = [u for u in urls if u.endswith(".js")]
        assert scripts and all("javascript" in client.get(u).headers["content-type"] for u in scripts)


TOKEN = "docs-test-token"


@pytest.fixture
def token_server(models_dir: Path) -> Iterator[str]:
    yield from _serve(Settings(models_dir=models_dir, cuda=False, api_token=TOKEN))


def test_docs_and_their_assets_need_the_token(token_server: str) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=token_server, timeout=30) as client:
        urls = _page_urls(client.get("/docs", headers=auth).text) + _page_urls(client.get("/redoc", headers=auth).text)
        for url in {"/docs", "/redoc", "/docs/oauth2-redirect", *urls}:
            assert client.get(url).status_code == 401, url
            assert client.get(url, headers=auth).status_code == 200, url
