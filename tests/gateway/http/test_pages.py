"""gateway/http/pages.py without a browser: presets, headers, static files, templates."""

from __future__ import annotations

import json
import re

import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from tokenrelay.gateway.http.pages import STATIC_DIR, TEMPLATES_DIR, page_routes, presets_from_query


@pytest.fixture(scope="module")
def client() -> TestClient:
    return TestClient(Starlette(routes=page_routes()))


def test_assets_are_where_the_packages_are() -> None:
    assert (TEMPLATES_DIR / "index.html").is_file()
    assert (TEMPLATES_DIR / "embed_demo.html").is_file()
    for name in ("tokenrelay-client.js", "tokenrelay-client.d.ts", "app.js", "widget.js"):
        assert (STATIC_DIR / name).is_file(), name
    assert (STATIC_DIR / "vendor" / "VERSIONS").is_file()


def test_presets_are_validated() -> None:
    p = presets_from_query(
        {"temperature": "0", "max_tokens": "64", "seed": "42", "system": "Be brief.", "x": "1"}
    )
    assert p.values == {"temperature": 0.0, "max_tokens": 64, "seed": 42, "system": "Be brief."}
    assert p.ignored == []
    bad = presets_from_query(
        {"temperature": "nan", "max_tokens": "0", "top_p": "0", "seed": "-1", "top_k": "x"}
    )
    assert bad.values == {}
    assert sorted(bad.ignored) == ["max_tokens", "seed", "temperature", "top_k", "top_p"]
    assert presets_from_query({"temperature": "inf"}).ignored == ["temperature"]
    assert presets_from_query({"max_tokens": "8193"}).ignored == ["max_tokens"]


def test_index_renders_presets_safely(client: TestClient) -> None:
    hostile = '</script><script>alert(1)</script>"'
    r = client.get("/", params={"temperature": "0", "max_tokens": "64", "system": hostile})
    assert r.status_code == 200
    html = r.text
    assert "<script>alert(1)</script>" not in html
    assert 'data-testid="composer"' in html and 'data-testid="send"' in html
    m = re.search(r'<script type="application/json" id="presets">(.*?)</script>', html, re.S)
    assert m is not None
    assert json.loads(m.group(1)) == {"temperature": 0.0, "max_tokens": 64, "system": hostile}
    assert 'value="64"' in html
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "object-src 'none'" in csp
    assert 'data-testid="debug-panel"' not in html
    assert 'data-testid="debug-panel"' in client.get("/?debug=1").text


def test_ignored_presets_are_reported(client: TestClient) -> None:
    html = client.get("/", params={"temperature": "hot"}).text
    assert 'data-testid="ignored-presets"' in html and "temperature" in html


def test_embed_demo_embeds_the_widget(client: TestClient) -> None:
    html = client.get("/embed-demo").text
    assert re.search(r'<script src="/static/widget\.js\?v=[^"]+" data-endpoint="http', html)
    assert 'data-title="Trail assistant"' in html


def test_static_files_have_cors_and_javascript_types(client: TestClient) -> None:
    for path in (
        "/static/tokenrelay-client.js",
        "/static/widget.js",
        "/static/vendor/marked.esm.js",
        "/static/vendor/purify.es.js",
    ):
        r = client.get(path)
        assert r.status_code == 200, path
        assert "javascript" in r.headers["content-type"], path
        assert r.headers["access-control-allow-origin"] == "*"
    assert client.get("/static/app.css").headers["content-type"].startswith("text/css")
    assert client.get("/static/__init__.py").status_code == 404
    assert client.get("/static/nope.js").status_code == 404
