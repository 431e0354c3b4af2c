"""``tokenrelay-client/ai-sdk``: TokenRelayChatTransport, the Vercel AI SDK's ChatTransport over
our WebSocket (static/tokenrelay-ai-sdk.js), with the pinned ``ai`` of tests/js (``make js``).

- types: the JSDoc type-checks strictly against ``ai``'s declarations (``@implements
  ChatTransport``) and the hand-written .d.ts matches it (tests/js/api-check.mjs); a strict
  TypeScript program (tests/js/consumer/ai_sdk_consumer.ts) compiles against the packed
  tarball, with ``ai``'s own AbstractChat, ChatTransport and UIMessage types, under bundler and
  nodenext resolution; Node imports the subpath from the tarball;
- Node, against the session's ``tokenrelay serve`` (tests/js/ai_sdk.mjs running
  tests/js/ai_sdk_checks.mjs): the AI SDK's AbstractChat (what ``useChat`` runs) streams two
  turns equal to the gateway's greedy answers, with chunks ``ai``'s schema accepts; Stop
  cancels the generation (the gateway's log ends ``cancelled``); after the first transport's
  socket goes mid-answer, ``resumeStream()`` on a new transport with the same store replays
  the whole answer; and reconnectToStream gives null for finished, unknown and expired chats;
- Chromium: a page loads ``ai`` and the transport as ES modules bundled by esbuild from the
  packed tarball (into a temp dir), streams an answer, is reloaded mid-answer and resumes it
  from localStorage, as ``useChat({resume: true})`` does.

The fake-server unit tests of the transport are tests/js/ai-sdk.test.mjs
(tests/web/test_js_client.py runs them).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.root import ROOT
from tests.web.conftest import Server, _open_page

STATIC = ROOT / "static"
JS_DIR = ROOT / "tests" / "js"
JS_TOOLS = JS_DIR / "node_modules"
AI = JS_TOOLS / "ai"
TYPESCRIPT = JS_TOOLS / "typescript"
ESBUILD = JS_TOOLS / "esbuild"
# esbuild's JS API (its bin/esbuild may be a JS shim or, after its install script, the binary)
BUNDLE = (
    "require(process.argv[1]).build({entryPoints: ['ai.js', 'transport.js'], bundle: true,"
    " format: 'esm', platform: 'browser', outdir: process.argv[2], logLevel: 'warning'})"
    ".catch(() => process.exit(1))"
)
MODULE = "tokenrelay-ai-sdk"
# the questions of tests/web/test_chat.py: the server's references are cached per session
SHORT_Q = "What is the capital of France?"
SHORT_MAX = 24
FOLLOW_UP = "And of Italy?"
LONG_Q = "Write a long story about a lighthouse keeper who finds a robot on the beach."
TOOLS_Q = "What is the weather in Paris?"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"],
        },
    },
}
# a named tool_choice: the model calls it, whatever the default model would do unasked
TOOLS_PARAMS = {
    "tools": [WEATHER],
    "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    "max_tokens": 120,
}


def _node() -> tuple[str, int]:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node >= 20 is not installed")
    out = subprocess.run([node, "--version"], capture_output=True, text=True, check=False)
    major = out.stdout.strip().lstrip("v").split(".")[0]
    if out.returncode != 0 or not major.isdigit() or int(major) < 20:
        pytest.skip(f"node >= 20 is needed, found {out.stdout.strip()}")
    if not (AI / "package.json").is_file() or not TYPESCRIPT.is_dir():
        pytest.skip("tests/js/node_modules has no ai or typescript: run `make js`")
    return node, int(major)


def _run(cmd: list[str], cwd: Path, timeout: float = 180) -> str:
    env = {**os.environ, "npm_config_update_notifier": "false"}
    proc = subprocess.run(
        cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False, env=env
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} (in {cwd}) failed:\n{out[-6000:]}"
    return out


def _tsc_errors(out: str) -> list[str]:
    """tsc's errors, but those in the declarations of `ai` and its dependencies (they want
    @types/node, which nothing of ours uses)."""
    errors = [line for line in out.splitlines() if "error TS" in line]
    return [e for e in errors if "node_modules" not in e or "node_modules/tokenrelay-client/" in e]


@pytest.fixture(scope="module")
def packed_app(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An app folder with the packed tarball of static/ installed (offline) and the pinned
    `ai` of tests/js linked into its node_modules, as `npm install tokenrelay-client ai`."""
    _node()
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed")
    root = tmp_path_factory.mktemp("ai-sdk-app")
    dist, app = root / "dist", root / "app"
    dist.mkdir()
    app.mkdir()
    cache = f"--cache={root / 'npm-cache'}"
    proc = subprocess.run(
        [npm, "pack", "--json", "--offline", cache, "--pack-destination", str(dist)],
        cwd=STATIC,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, f"npm pack failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    packed = json.loads(proc.stdout[proc.stdout.index("[") :])
    assert {f"{MODULE}.js", f"{MODULE}.d.ts"} <= {f["path"] for f in packed[0]["files"]}
    (app / "package.json").write_text(
        json.dumps({"name": "app", "private": True, "type": "module"})
    )
    tarball = dist / packed[0]["filename"]
    install = [npm, "install", str(tarball), "--offline", cache, "--ignore-scripts"]
    _run([*install, "--no-audit", "--no-fund"], app)
    (app / "node_modules" / "ai").symlink_to(AI, target_is_directory=True)
    return app


# --- types ------------------------------------------------------------------------------------


def test_handwritten_declarations_match_the_jsdoc(tmp_path: Path) -> None:
    """tests/js/api-check.mjs over the transport alone: its JSDoc type-checks with `--strict`
    against `ai`'s declarations (`@implements ChatTransport`), and the .d.ts declares the same
    API. The client's declarations stand in for its JS on both sides (the client's JSDoc has
    its own checks, tests/web/test_js_package.py)."""
    node, _ = _node()
    impl, decl = tmp_path / "impl", tmp_path / "decl"
    impl.mkdir()
    decl.mkdir()
    shutil.copy(STATIC / f"{MODULE}.js", impl)
    (impl / "client").mkdir()
    shutil.copy(STATIC / "client" / "ai-sdk-chunks.js", impl / "client")  # its chunks
    shutil.copy(STATIC / f"{MODULE}.d.ts", decl)
    for d in (impl, decl):
        for name in ("tokenrelay-client.d.ts", "tokenrelay-protocol.d.ts"):
            shutil.copy(STATIC / name, d)
    (tmp_path / "node_modules").symlink_to(JS_TOOLS, target_is_directory=True)
    out = _run(
        [node, str(JS_DIR / "api-check.mjs"), str(TYPESCRIPT), str(impl), str(decl), MODULE],
        tmp_path,
    )
    assert "ok: the .d.ts files match the JSDoc" in out, out


def test_a_strict_typescript_consumer_compiles_and_node_imports_the_subpath(
    packed_app: Path,
) -> None:
    node, _ = _node()
    installed = packed_app / "node_modules" / "tokenrelay-client"
    pkg = json.loads((installed / "package.json").read_text())
    assert pkg["peerDependencies"] == {"ai": ">=5"}
    assert pkg["peerDependenciesMeta"] == {"ai": {"optional": True}}
    shutil.copy(JS_DIR / "consumer" / "ai_sdk_consumer.ts", packed_app / "consumer.ts")
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
                # our .d.ts is checked by the api-check above; `ai`'s want @types/node
                "skipLibCheck": True,
            },
            "files": ["consumer.ts"],
        }
        (packed_app / "tsconfig.json").write_text(json.dumps(config))
        proc = subprocess.run(
            [node, str(TYPESCRIPT / "bin" / "tsc"), "-p", "tsconfig.json", "--pretty", "false"],
            cwd=packed_app,
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        errors = _tsc_errors(proc.stdout + proc.stderr)
        assert errors == [], f"{resolution}:\n" + "\n".join(errors)

    smoke = (
        'import { TokenRelayChatTransport, toRelayMessages } from "tokenrelay-client/ai-sdk";\n'
        'const t = new TokenRelayChatTransport({ url: "http://gw.test" });\n'
        'const hi = { id: "u", role: "user", parts: [{ type: "text", text: "Hi" }] };\n'
        "const m = toRelayMessages([hi]);\n"
        "console.log(t.client.url, t.store instanceof Map, JSON.stringify(m));\n"
    )
    (packed_app / "smoke.mjs").write_text(smoke)
    out = _run([node, "smoke.mjs"], packed_app)
    assert 'ws://gw.test/v1/ws true [{"role":"user","content":"Hi"}]' in out, out


# --- against a real gateway -------------------------------------------------------------------


def greedy(server: Server, messages: list[dict[str, str]], params: dict[str, Any]) -> str:
    """The gateway's uninterrupted answer, straight from the WebSocket API."""
    frames = server.run(
        [{"type": "generate", "request_id": "greedy", "messages": messages, "params": params}]
    )
    assert frames[-1]["type"] == "done", frames[-3:]
    tokens = sorted((f for f in frames if f["type"] == "token"), key=lambda f: f["seq"])
    return "".join(f["text"] for f in tokens)


def tool_call(server: Server, params: dict[str, Any]) -> dict[str, str]:
    """The call the gateway's own answer makes (its ``done`` frame), straight from the
    WebSocket API."""
    messages = [{"role": "user", "content": TOOLS_Q}]
    frames = server.run(
        [{"type": "generate", "request_id": "call", "messages": messages, "params": params}]
    )
    done = frames[-1]
    assert done["type"] == "done" and done["finish_reason"] == "tool_calls", frames[-3:]
    return dict(done["tool_calls"][0]["function"])


def _config(server: Server) -> dict[str, Any]:
    return {
        "url": server.base,
        "params": {"temperature": 0, "top_p": 1, "max_tokens": SHORT_MAX},
        "question": SHORT_Q,
        "followUp": FOLLOW_UP,
        "long": {"question": LONG_Q, "params": {"max_tokens": server.long_max_tokens(LONG_Q)}},
        "tools": {"question": TOOLS_Q, "params": TOOLS_PARAMS},
    }


def test_node_chat_streams_stops_and_resumes_after_a_reload(server: Server) -> None:
    node, major = _node()
    cfg = _config(server)
    long_max = cfg["long"]["params"]["max_tokens"]
    flags = ["--experimental-websocket"] if major < 22 else []
    proc = subprocess.run(
        [node, *flags, str(JS_DIR / "ai_sdk.mjs"), json.dumps(cfg)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=420,
        check=False,
    )
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])

    first = server.reference(SHORT_Q, SHORT_MAX)
    chat = out["chat"]
    assert chat["first"] == first
    history = [
        {"role": "user", "content": SHORT_Q},
        {"role": "assistant", "content": first},
        {"role": "user", "content": FOLLOW_UP},
    ]
    assert chat["second"] == greedy(server, history, cfg["params"]), "the history went back"
    assert chat["roles"] == ["user", "assistant", "user", "assistant"]
    assert (chat["status"], chat["error"]) == ("ready", None)
    assert [f["isAbort"] or f["isError"] for f in chat["finishes"]] == [False, False]
    types = chat["chunkTypes"]
    deltas = len(types) - 6
    assert deltas >= 1 and types == [
        "start",
        "start-step",
        "text-start",
        *["text-delta"] * deltas,
        "text-end",
        "finish-step",
        "finish",
    ], types
    assert chat["invalidChunks"] == [], "chunks that ai's uiMessageChunkSchema refuses"
    assert chat["storedWhileStreaming"] == 1 and chat["storeAfter"] == 0
    assert chat["reconnect"] is None, "a finished chat has nothing to reconnect to"

    # a tool call: streamed into the tool part as the gateway streams it, then whole
    call = tool_call(server, {**cfg["params"], **TOOLS_PARAMS})
    tools = out["tools"]
    assert (tools["status"], tools["error"], tools["invalidChunks"]) == ("ready", None, [])
    types = tools["chunkTypes"]
    starts, deltas = types.count("tool-input-start"), types.count("tool-input-delta")
    assert starts == 1 and deltas >= 2, types
    assert types.index("tool-input-start") < types.index("tool-input-delta")
    assert types[-3:] == ["tool-input-available", "finish-step", "finish"], types
    assert tools["part"] == {"type": "tool-get_weather", "state": "input-available",
                             "input": json.loads(call["arguments"]),
                             "toolCallId": tools["part"]["toolCallId"]}  # fmt: skip
    states = [s["state"] for s in tools["seen"]]
    assert states[0] == "input-streaming" and states[-1] == "input-available", states
    assert "input-streaming" in states[:-1], "the input showed while it streamed"
    assert tools["finishes"][0]["finishReason"] == "tool-calls"

    # Stop: the AI SDK aborts, the gateway's log of the stream ends `cancelled`, early
    long = server.reference(LONG_Q, long_max)
    stop = out["stop"]
    assert stop["partial"] and long.startswith(stop["partial"])
    assert stop["status"] == "ready" and stop["finishes"][0]["isAbort"] is True
    frames = server.run(
        [
            {
                "type": "resume",
                "stream_id": stop["streamId"],
                "resume_token": stop["resumeToken"],
                "after": 0,
            }
        ]
    )
    done = frames[-1]
    assert done["type"] == "done" and done["finish_reason"] == "cancelled", frames[-3:]
    text = "".join(f["text"] for f in frames if f["type"] == "token")
    assert long.startswith(text) and len(text) < len(long)
    assert stop["reconnect"] is None

    # a reload mid-answer: the new transport's resumeStream() rebuilds the whole answer
    reload = out["reload"]
    assert reload["partialBefore"] and len(reload["partialBefore"]) < len(long)
    assert long.startswith(reload["partialBefore"])
    assert reload["text"] == long
    assert reload["messageId"] == reload["storedMessageId"]
    assert reload["messages"] == 1 and reload["messagesAfterSecondResume"] == 1
    assert (reload["status"], reload["error"]) == ("ready", None)
    assert [f["isAbort"] or f["isError"] for f in reload["finishes"]] == [False]
    assert reload["storeAfter"] == 0 and reload["reconnect"] is None

    assert out["none"] == {"unknown": None, "notFound": None, "entryCleared": True}


HOST_PAGE = b"""<!doctype html>
<meta charset="utf-8">
<link rel="icon" href="data:,">
<title>loading</title>
<script type="module">
import { AbstractChat } from "./ai.js";
import { TokenRelayChatTransport } from "./transport.js";
import { pageResume, pageStart } from "./ai_sdk_checks.mjs";
const deps = { AbstractChat, TokenRelayChatTransport };
const guard = (run) => (cfg) =>
  run(deps, cfg).catch((err) => ({ failed: `${err?.name}: ${err?.message}` }));
window.pageStart = guard(pageStart);
window.pageResume = guard(pageResume);
document.title = "ready";
</script>
"""


class _Site:
    """A dev server on another port than the gateway, serving the page and its bundles."""

    def __init__(self, folder: Path) -> None:
        class Handler(SimpleHTTPRequestHandler):
            extensions_map = {
                **SimpleHTTPRequestHandler.extensions_map,
                ".js": "text/javascript",
                ".mjs": "text/javascript",
            }

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), partial(Handler, directory=str(folder)))
        self.origin = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


@pytest.fixture
def bundled_site(packed_app: Path, tmp_path: Path) -> Iterator[_Site]:
    """`ai` and `tokenrelay-client/ai-sdk` bundled by esbuild as two ES modules (what a
    frontend build makes of them), next to the page and tests/js/ai_sdk_checks.mjs."""
    node, _ = _node()
    if not (ESBUILD / "package.json").is_file():
        pytest.skip("tests/js/node_modules has no esbuild: run `make js`")
    (packed_app / "ai.js").write_text('export * from "ai";\n')
    (packed_app / "transport.js").write_text('export * from "tokenrelay-client/ai-sdk";\n')
    site = tmp_path / "site"
    _run([node, "-e", BUNDLE, str(ESBUILD), str(site)], packed_app)
    shutil.copy(JS_DIR / "ai_sdk_checks.mjs", site / "ai_sdk_checks.mjs")
    (site / "index.html").write_bytes(HOST_PAGE)
    host = _Site(site)
    try:
        yield host
    finally:
        host.stop()


def test_chromium_page_streams_and_resumes_after_a_reload(
    browser: Any, server: Server, bundled_site: _Site
) -> None:
    cfg = _config(server)
    long = server.reference(LONG_Q, cfg["long"]["params"]["max_tokens"])
    h = _open_page(browser, viewport={"width": 800, "height": 600})
    try:
        h.page.goto(bundled_site.origin + "/")
        h.page.wait_for_function("document.title === 'ready'")
        before = h.page.evaluate("cfg => window.pageStart(cfg)", cfg)
        assert "failed" not in before, before
        h.page.reload()  # mid-answer: the socket goes, the gateway keeps generating
        h.page.wait_for_function("document.title === 'ready'")
        after = h.page.evaluate("cfg => window.pageResume(cfg)", cfg)
        errors = h.console_errors()
    finally:
        h.context.close()
    assert "failed" not in after, after

    assert before["short"]["text"] == server.reference(SHORT_Q, SHORT_MAX)
    assert before["short"]["status"] == "ready"
    assert before["partial"] and long.startswith(before["partial"])
    assert len(before["partial"]) < len(long)
    stored = json.loads(before["stored"])
    assert set(stored) == {"streamId", "resumeToken", "messageId"}
    assert after["stored"] == before["stored"], "localStorage kept it across the reload"
    assert after["text"] == long
    assert after["messages"] == 1 and (after["status"], after["error"]) == ("ready", None)
    assert after["afterFinish"] == {"messages": 0, "status": "ready"}
    assert after["reconnect"] is None
    assert errors == [], errors
