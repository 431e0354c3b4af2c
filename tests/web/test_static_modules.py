"""The layout of static/ without a browser: small modules, imports that resolve and do not go
round in circles, every module in the wheel and served, and the widget's modules loaded by
widget.js only (each with the `?v=` of the script tag).

Entry points: app.js (the chat page, web/templates/index.html) over app/; widget.js (the
embed) over widget/; tokenrelay-client.js and tokenrelay-protocol.js (the npm package,
tests/web/test_js_package.py) over client/.
"""

from __future__ import annotations

import re
from pathlib import Path

from starlette.applications import Starlette
from starlette.testclient import TestClient

from tests.root import ROOT
from tests.web.static_files import (
    STATIC,
    dynamic_imports,
    modules,
    static_imports,
    wheel_installs,
)
from tokenrelay.gateway.http.pages import page_routes

MAX_LINES = 400  # as for Python modules (tests/test_architecture.py)
FOLDERS = ("app", "client", "widget")


def _name(path: Path) -> str:
    return path.resolve().relative_to(STATIC.resolve()).as_posix()


def test_the_modules_are_where_the_architecture_says() -> None:
    names = {_name(p) for p in modules()}
    for entry in ("app.js", "widget.js", "tokenrelay-client.js", "tokenrelay-protocol.js"):
        assert entry in names, entry
    for folder in FOLDERS:
        assert any(n.startswith(f"{folder}/") for n in names), folder
    nested = [n for n in names if n.count("/") > 1]
    assert not nested, f"one folder level under static/ (pyproject globs one each): {nested}"


def test_modules_are_small_or_say_why() -> None:
    """One concept per module: at most MAX_LINES lines, unless its header says why (`Long:`)."""
    long = []
    for path in modules():
        text = path.read_text()
        n = text.count("\n")
        if n > MAX_LINES and "Long:" not in text[:2000]:
            long.append(f"static/{_name(path)}: {n} lines")
    assert not long, long


def test_relative_imports_resolve_and_have_no_cycles() -> None:
    graph: dict[str, list[str]] = {}
    for path in modules():
        deps = []
        for target in static_imports(path):
            assert target.is_file(), f"static/{_name(path)} imports a missing {target}"
            assert STATIC.resolve() in target.parents, f"static/{_name(path)} imports {target}"
            deps.append(_name(target))
        graph[_name(path)] = deps

    def visit(node: str, trail: tuple[str, ...]) -> None:
        assert node not in trail, "import cycle: " + " -> ".join((*trail, node))
        for dep in graph.get(node, []):
            visit(dep, (*trail, node))

    for node in graph:
        visit(node, ())


def test_every_module_ships_in_the_wheel_and_is_served() -> None:
    client = TestClient(Starlette(routes=page_routes()))
    for path in modules():
        name = _name(path)
        assert wheel_installs(path), f"static/{name} is not in pyproject's data-files"
        r = client.get(f"/static/{name}")
        assert r.status_code == 200, name
        assert "javascript" in r.headers["content-type"], name
        assert r.headers["access-control-allow-origin"] == "*", name
        assert r.headers["cache-control"] == "no-cache", name


def test_the_chat_page_loads_app_js_as_a_versioned_module() -> None:
    template = (ROOT / "web" / "templates" / "index.html").read_text()
    assert re.search(
        r'<script type="module" src="\{\{ static_base \}\}/app\.js\?v=\{\{ asset_version \}\}">',
        template,
    )
    # its modules import each other statically (one instance each: never a second copy of a
    # module under another URL), revalidated on every load (`no-cache`)
    for path in [STATIC / "app.js", *sorted((STATIC / "app").glob("*.js"))]:
        assert not dynamic_imports(path), f"static/{_name(path)}"
        for target in static_imports(path):
            assert _name(target).startswith("app/") or "/" not in _name(target), _name(target)


def test_the_widget_loader_loads_every_widget_module_with_its_version() -> None:
    """widget.js stays a classic script (no import/export statement) that import()s each
    module with `asset()` (its own `?v=`); the modules import nothing themselves, so none is
    ever fetched without that version or twice under two URLs."""
    loader = STATIC / "widget.js"
    source = loader.read_text()
    assert not static_imports(loader) and not re.search(r"^\s*export\b", source, re.M)
    loaded = set(re.findall(r'import\(asset\("([^"]+)"\)\)', source))
    assert loaded == {
        "tokenrelay-client.js",
        "markdown.js",
        *(f"widget/{p.name}" for p in (STATIC / "widget").glob("*.js")),
    }
    assert not dynamic_imports(loader), "every import() in widget.js goes through asset()"
    for path in sorted((STATIC / "widget").glob("*.js")):
        assert not static_imports(path), f"static/{_name(path)} imports: widget.js hands it in"
        assert not dynamic_imports(path), f"static/{_name(path)}"
