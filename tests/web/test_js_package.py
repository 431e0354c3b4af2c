"""The JS client as an npm package (static/package.json): its manifest, its types, its tarball.

- the manifest ships every module the client imports (the two entry points and their internal
  modules in static/client/), the gateway serves them and the wheel installs them
  (pyproject's data-files);
- the JSDoc of static/tokenrelay-client.js and static/tokenrelay-protocol.js (and of the
  modules in static/client/ behind them) type-checks with ``tsc --strict --checkJs``, and
  declarations can be generated from it;
- the hand-written .d.ts files still describe the JS (tests/js/api-check.mjs: the same
  exports and public members, the JS types assignable to the declared ones), the widget's
  (static/widget.d.ts) included: against static/widget/api.js, which ``tokenrelay-client/widget``
  is at run time (the element itself comes from the gateway's widget.js);
- ``npm pack`` gives a tarball that installs offline, and a TypeScript consumer
  (tests/js/consumer/consumer.ts) compiles against it with ``--strict``, under bundler and
  nodenext module resolution; Node imports the entry points from it (``tokenrelay-client/widget``
  too).

Needs node >= 20 and the pinned typescript of tests/js (``make js``); the tests skip, with the
reason, without them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from tests.root import ROOT
from tests.web.static_files import STATIC, dynamic_imports, static_imports, wheel_installs
from tokenrelay.gateway.http.pages import page_routes

PACKAGE_JSON = STATIC / "package.json"
MODULES = ("tokenrelay-protocol", "tokenrelay-client")
INTERNAL = "client"  # static/client/: the modules behind the two entry points
# `tokenrelay-client/widget`: the element's types, and the one widget module that needs no DOM
WIDGET = {"types": "./widget.d.ts", "default": "./widget/api.js"}
JS_TOOLS = ROOT / "tests" / "js" / "node_modules"
TSC = JS_TOOLS / ".bin" / "tsc"
TYPESCRIPT = JS_TOOLS / "typescript"
# skipLibCheck: lib.dom.d.ts is not ours (our .d.ts files are checked with it off below)
TSC_FLAGS = ["--target", "es2022", "--lib", "es2022,dom", "--pretty", "false", "--skipLibCheck"]


def _package() -> dict[str, object]:
    data = json.loads(PACKAGE_JSON.read_text())
    assert isinstance(data, dict)
    return data


def _pyproject() -> dict[str, object]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _node() -> str:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node >= 20 is not installed")
    out = subprocess.run([node, "--version"], capture_output=True, text=True, check=False)
    major = int(out.stdout.strip().lstrip("v").split(".")[0] or 0) if out.returncode == 0 else 0
    if major < 20:
        pytest.skip(f"node >= 20 is needed, found {out.stdout.strip()}")
    return node


def _tsc() -> list[str]:
    node = _node()
    if not TSC.exists() or not TYPESCRIPT.is_dir():
        pytest.skip("tests/js/node_modules has no typescript: run `make js`")
    return [node, str(TYPESCRIPT / "bin" / "tsc")]


def _npm() -> str:
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed")
    return npm


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        cmd,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env={**os.environ, **(env or {})},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} (in {cwd}) failed:\n{out[-6000:]}"
    return out


def _shipped() -> list[str]:
    files = _package()["files"]
    assert isinstance(files, list)
    return [str(f) for f in files]


# --- the manifest -----------------------------------------------------------------------------


def test_manifest_describes_an_es_module_package() -> None:
    pkg = _package()
    project = _pyproject()["project"]
    assert isinstance(project, dict)
    assert pkg["name"] == "tokenrelay-client"
    assert pkg["type"] == "module"
    assert pkg["version"] == project["version"], "keep the client's version with the gateway's"
    assert pkg["license"] == project["license"]
    assert pkg["main"] == "./tokenrelay-client.js"
    assert pkg["types"] == "./tokenrelay-client.d.ts"
    exports = pkg["exports"]
    assert isinstance(exports, dict)
    assert exports["."] == {
        "types": "./tokenrelay-client.d.ts",
        "default": "./tokenrelay-client.js",
    }
    assert exports["./protocol"] == {
        "types": "./tokenrelay-protocol.d.ts",
        "default": "./tokenrelay-protocol.js",
    }
    assert exports["./widget"] == WIDGET
    shipped = _shipped()
    for entry in exports.values():
        targets = entry.values() if isinstance(entry, dict) else [entry]
        for target in targets:
            name = str(target).removeprefix("./")
            assert (STATIC / name).is_file(), target
            assert name in shipped or name == "package.json", f"{target} is not in `files`"
    assert (STATIC / "README.md").is_file()


def test_every_imported_module_is_shipped_served_and_installed() -> None:
    """The client's relative imports are in the package, behind /static and in the wheel;
    the two entry points have their .d.ts, and the internal modules none (TypeScript users
    see only the entry points' declarations, which import nothing but each other)."""
    shipped = set(_shipped())
    for name in shipped:
        assert (STATIC / name).is_file(), name
    for name in [n for n in shipped if n.endswith(".js")]:
        module = STATIC / name
        assert not dynamic_imports(module), f"{name}: the package loads nothing dynamically"
        for imported in static_imports(module):
            rel = imported.relative_to(STATIC.resolve()).as_posix()
            assert rel in shipped, f"{name} imports {rel}, which is not shipped"
    for m in MODULES:
        assert f"{m}.js" in shipped and f"{m}.d.ts" in shipped, m
    # of the widget, its types and api.js only: its other modules need widget.js and a DOM
    assert sorted(n for n in shipped if n.startswith("widget")) == ["widget.d.ts", "widget/api.js"]
    assert not static_imports(STATIC / "widget" / "api.js")
    internal = sorted(n for n in shipped if n.startswith(f"{INTERNAL}/"))
    assert internal == sorted(
        p.relative_to(STATIC).as_posix() for p in (STATIC / INTERNAL).glob("*.js")
    ), "static/client/ holds the package's internal modules: ship each of them, and only them"
    for name in [n for n in shipped if n.endswith(".d.ts")]:
        for imported in static_imports(STATIC / name):
            rel = imported.relative_to(STATIC.resolve()).as_posix()
            assert rel.removesuffix(".js") + ".d.ts" in shipped, f"{name} imports {rel}"
    for name in shipped:
        assert wheel_installs(STATIC / name), (
            f"static/{name} is not in pyproject's data-files: a wheel would not serve it"
        )
    client = TestClient(Starlette(routes=page_routes()))
    for name in shipped:
        r = client.get(f"/static/{name}")
        assert r.status_code == 200, name
        if name.endswith(".js"):
            assert "javascript" in r.headers["content-type"], name
            assert r.headers["access-control-allow-origin"] == "*"


# --- types ------------------------------------------------------------------------------------


def test_jsdoc_typechecks_strictly_and_declarations_generate(tmp_path: Path) -> None:
    tsc = _tsc()
    # the .js alone (no .d.ts beside it), so everything is typed by the JSDoc
    for m in MODULES:
        shutil.copy(STATIC / f"{m}.js", tmp_path / f"{m}.js")
    shutil.copytree(STATIC / INTERNAL, tmp_path / INTERNAL)
    out = tmp_path / "types"
    _run(
        [
            *tsc,
            *TSC_FLAGS,
            "--allowJs",
            "--checkJs",
            "--strict",
            "--module",
            "es2022",
            "--moduleResolution",
            "bundler",
            "--declaration",
            "--emitDeclarationOnly",
            "--outDir",
            str(out),
            *(f"{m}.js" for m in MODULES),
        ],
        cwd=tmp_path,
    )
    for m in MODULES:
        assert (out / f"{m}.d.ts").stat().st_size > 0
    # in place: the client checked against the protocol module's hand-written .d.ts
    _run(
        [
            *tsc,
            *TSC_FLAGS,
            "--allowJs",
            "--checkJs",
            "--strict",
            "--noEmit",
            "--module",
            "es2022",
            "--moduleResolution",
            "bundler",
            "static/tokenrelay-client.js",
        ],
        cwd=ROOT,
    )


def test_handwritten_declarations_match_the_jsdoc(tmp_path: Path) -> None:
    node = _tsc()[0]
    impl = tmp_path / "impl"
    decl = tmp_path / "decl"
    impl.mkdir()
    decl.mkdir()
    for m in MODULES:
        shutil.copy(STATIC / f"{m}.js", impl / f"{m}.js")
        shutil.copy(STATIC / f"{m}.d.ts", decl / f"{m}.d.ts")
    shutil.copytree(STATIC / INTERNAL, impl / INTERNAL)
    # widget.d.ts describes widget/api.js (self-contained: it imports nothing)
    shutil.copy(STATIC / "widget" / "api.js", impl / "widget.js")
    shutil.copy(STATIC / "widget.d.ts", decl / "widget.d.ts")
    out = _run(
        [
            node,
            str(ROOT / "tests" / "js" / "api-check.mjs"),
            str(TYPESCRIPT),
            str(impl),
            str(decl),
            *MODULES,
            "widget",
        ],
        cwd=tmp_path,
    )
    assert "ok: the .d.ts files match the JSDoc" in out, out
    assert "widget: 4 value exports, 6 JSDoc types checked" in out, out


# --- the tarball ------------------------------------------------------------------------------


def test_packed_tarball_installs_and_a_strict_typescript_consumer_compiles(
    tmp_path: Path,
) -> None:
    tsc = _tsc()
    node = tsc[0]
    npm = _npm()
    env = {"npm_config_cache": str(tmp_path / "npm-cache"), "npm_config_update_notifier": "false"}
    dist = tmp_path / "dist"
    dist.mkdir()
    packed = json.loads(_pack(npm, dist, env))
    files = sorted(f["path"] for f in packed[0]["files"])
    assert files == sorted(["package.json", "README.md", "LICENSE", *_shipped()])
    assert not (STATIC / "LICENSE").exists()  # copied from the root for the tarball only
    tarball = dist / packed[0]["filename"]
    assert tarball.is_file()

    app = tmp_path / "app"
    app.mkdir()
    (app / "package.json").write_text(
        json.dumps({"name": "consumer", "private": True, "type": "module"})
    )
    _run(
        [npm, "install", str(tarball), "--offline", "--no-audit", "--no-fund", "--ignore-scripts"],
        app,
        env,
    )
    installed = app / "node_modules" / "tokenrelay-client"
    assert (installed / "tokenrelay-client.d.ts").is_file()
    assert (installed / INTERNAL / "client.js").is_file()
    assert not (installed / "app.js").exists()
    assert not (installed / "app").exists()
    assert sorted(p.name for p in (installed / "widget").iterdir()) == ["api.js"]

    shutil.copy(ROOT / "tests" / "js" / "consumer" / "consumer.ts", app / "consumer.ts")
    for module, resolution in (("esnext", "bundler"), ("nodenext", "nodenext")):
        config = {
            "compilerOptions": {
                "strict": True,
                "noEmit": True,
                "target": "es2022",
                "lib": ["es2022", "dom"],
                "module": module,
                "moduleResolution": resolution,
                "types": [],
                "skipLibCheck": False,
                "noUnusedLocals": False,
            },
            "files": ["consumer.ts"],
        }
        (app / "tsconfig.json").write_text(json.dumps(config))
        _run([*tsc, "-p", "tsconfig.json", "--pretty", "false"], app)

    smoke = (
        'import { TokenRelayClient, TokenRelayError, DEFAULTS } from "tokenrelay-client";\n'
        'import { ClientProtocol } from "tokenrelay-client/protocol";\n'
        'import { ATTRIBUTES, STRINGS, resolveStrings } from "tokenrelay-client/widget";\n'
        'const fr = resolveStrings({ send: "Envoyer", nope: "x" });\n'
        'if (fr.send !== "Envoyer" || fr.stop !== STRINGS.stop) throw new Error("strings");\n'
        'if ("nope" in fr) throw new Error("an unknown key was taken");\n'
        'if (!ATTRIBUTES.includes("model")) throw new Error("no model attribute");\n'
        "const p = new ClientProtocol();\n"
        'p.generate({ prompt: "x", requestId: "r1" });\n'
        "p.opened(1);\n"
        "const a = p.nextAction();\n"
        'if (a.type !== "send" || a.frame.request_id !== "r1") throw new Error("no generate");\n'
        'const c = new TokenRelayClient({ endpoint: "http://gw.test", window: null });\n'
        'if (c.url !== "ws://gw.test/v1/ws" || DEFAULTS.retryLimit !== 8) throw new Error("?");\n'
        'console.log("imported", typeof TokenRelayError);\n'
    )
    (app / "smoke.mjs").write_text(smoke)
    assert "imported function" in _run([node, "smoke.mjs"], app)


def _pack(npm: str, dist: Path, env: dict[str, str]) -> str:
    """`npm pack --json` in static/; its JSON (npm may print notices before it)."""
    out = subprocess.run(
        [npm, "pack", "--json", "--offline", "--pack-destination", str(dist)],
        cwd=STATIC,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, **env},
    )
    assert out.returncode == 0, f"npm pack failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout[out.stdout.index("[") :]
