"""The dependency rules of docs/architecture.md, checked from the source.

Every import in core/, gateway/, worker/, engine/ and client/ counts (module level or
inside a function), except those under ``if TYPE_CHECKING:``, which never run.
The folders are the packages ``tokenrelay.core``, ``tokenrelay.gateway``, ... (one
import namespace, pyproject's package-dir); nothing imports or names them by their
bare folder names.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.root import ROOT

NS = "tokenrelay"  # the one import namespace: core/ is tokenrelay.core, ...
PACKAGES = ("core", "gateway", "worker", "engine", "client")
OLD_NAMES = PACKAGES  # the bare top-level names they had before the namespace
MAX_LINES = 400  # a longer module says why in its docstring ("Long: ...")


def _ns(*names: str) -> tuple[str, ...]:
    return tuple(f"{NS}.{n}" for n in names)


WEB = ("starlette", "uvicorn")
SANS_IO = ("asyncio", "socket", "starlette", "redis")
# package (or module) prefix -> imports it must never make
FORBIDDEN: dict[str, tuple[str, ...]] = {
    f"{NS}.core": (*_ns("gateway", "worker", "engine"), "torch", "transformers", *WEB),
    f"{NS}.gateway": (*_ns("engine", "worker"), "torch", "transformers"),
    f"{NS}.worker": (*_ns("gateway"), *WEB),
    f"{NS}.engine": (
        *_ns("gateway", "worker"),
        *("redis", *WEB),
        *(f"{NS}.core.{m}" for m in ("redis", "cli", "serve", "options", "entry")),
    ),
    # the Python client: the base install's protocol, over a socket; nothing of the servers
    f"{NS}.client": (
        *_ns("gateway", "worker", "engine", "v1"),
        *("torch", "transformers", "redis", "grpc", *WEB),
        *(f"{NS}.core.{m}" for m in ("redis", "cli", "serve", "options", "entry")),
    ),
    f"{NS}.client.frames": (*SANS_IO, "websockets"),
    f"{NS}.client.state": (*SANS_IO, "websockets"),
    f"{NS}.client.retry": (*SANS_IO, "websockets"),
    f"{NS}.client.errors": (*SANS_IO, "websockets"),
    # torch-free bookkeeping (unit-tested fast and exactly)
    f"{NS}.engine.scheduling": ("torch",),
    # sans-I/O: no sockets, no event loop, no web framework, no Redis
    f"{NS}.gateway.session.protocol": SANS_IO,
    f"{NS}.gateway.http.sse": SANS_IO,
    f"{NS}.gateway.http.openai_request": SANS_IO,
    f"{NS}.gateway.http.openai_render": SANS_IO,
    f"{NS}.gateway.http.openai_body": SANS_IO,
    f"{NS}.gateway.http.openai_fields": SANS_IO,
    f"{NS}.gateway.grpc.convert": (*SANS_IO, "grpc"),
    f"{NS}.core.wire": ("asyncio", "socket", "redis"),
    # the relay worker: no model, no torch (a relay machine need not have either)
    f"{NS}.worker.upstream": (f"{NS}.engine", "torch", "transformers", "tokenizers", "numpy"),
    f"{NS}.worker.upstream.openai": ("asyncio", "socket", "httpx", "redis"),
    f"{NS}.worker.upstream.failures": ("asyncio", "socket", "httpx", "redis"),
    f"{NS}.worker.upstream.http1": ("asyncio", "socket", "ssl", "httpx", "redis"),
}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = (NS, *path.relative_to(ROOT).with_suffix("").parts)
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                yield from _import_nodes(child)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        yield from _import_nodes(node)


def imports_of(module: str) -> set[str]:
    """Every module ``module`` imports, absolute (``from a import b``: also a.b if a module)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")
            anchor = anchor[: len(anchor) - node.level + 1]
            base = ".".join([*anchor, base] if base else anchor)
        out.add(base)
        out.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES)
    return out


GRAPH = {m: {d for d in imports_of(m) if d in MODULES and d != m} for m in MODULES}


def _matches(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_every_package_is_found() -> None:
    for pkg in PACKAGES:
        assert f"{NS}.{pkg}" in MODULES
    assert len(MODULES) > 60


@pytest.mark.parametrize("module", sorted(MODULES))
def test_dependencies_point_one_way(module: str) -> None:
    bad = sorted(
        f"{module} imports {dep} (forbidden for {prefix})"
        for prefix, banned in FORBIDDEN.items()
        if _matches(module, prefix)
        for dep in imports_of(module)
        for ban in banned
        if _matches(dep, ban)
    )
    assert not bad, "\n".join(bad)


def test_a_relay_worker_never_loads_torch() -> None:
    """What ``tokenrelay worker --upstream`` imports, run for real in a fresh interpreter:
    the worker loop, its upstream engine, and everything they import at module level."""
    import subprocess
    import sys

    probe = (
        "import sys, tokenrelay.worker.main, tokenrelay.worker.upstream.engine;"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'transformers', 'numpy') or m.startswith('tokenrelay.engine'));"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_python_client_loads_no_server_part() -> None:
    """``import tokenrelay.client``, run for real in a fresh interpreter: no torch, no web
    framework, no Redis, nothing of the gateway, the worker or the engine."""
    import subprocess
    import sys

    probe = (
        "import sys, tokenrelay.client;"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'transformers', 'numpy', 'starlette', 'uvicorn', 'redis', 'grpc') or "
        "m.startswith(('tokenrelay.gateway', 'tokenrelay.worker', 'tokenrelay.engine')));"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr


def test_no_import_cycles() -> None:
    # Tarjan's strongly connected components over the module graph
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_a_package_init_imports_nothing_of_its_own_subpackages_eagerly() -> None:
    # `import core` must stay cheap and free of what sits below it
    for pkg in _ns("core", "gateway", "worker"):
        assert not GRAPH[pkg], f"{pkg} (its __init__.py) imports {sorted(GRAPH[pkg])}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_modules_stay_small_or_say_why(module: str) -> None:
    path = MODULES[module]
    lines = len(path.read_text().splitlines())
    if lines > MAX_LINES:
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        assert "Long:" in doc, f"{path.relative_to(ROOT)} has {lines} lines and no 'Long:' reason"


def test_the_checker_sees_a_forbidden_import(tmp_path: Path) -> None:
    """The import reader resolves relative, nested and TYPE_CHECKING imports as documented."""
    src = (
        "from typing import TYPE_CHECKING\n"
        "from . import sibling\n"
        "if TYPE_CHECKING:\n    import torch\n"
        "def f():\n    import tokenrelay.gateway.state\n"
    )
    path = ROOT / "core" / "_probe_for_test.py"
    path.write_text(src)
    try:
        MODULES["core._probe_for_test"] = path
        found = imports_of("core._probe_for_test")
    finally:
        path.unlink()
        del MODULES["core._probe_for_test"]
    assert "tokenrelay.gateway.state" in found
    assert "core.sibling" in found or "core" in found
    assert "torch" not in found


def _python_files() -> list[Path]:
    skip = {".venv", "node_modules", "build", ".git"}
    return [p for p in sorted(ROOT.rglob("*.py")) if not skip & set(p.relative_to(ROOT).parts)]


def _is_our_module(dotted: str) -> bool:
    if not all(part.isidentifier() for part in dotted.split(".")):
        return False
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def test_nothing_uses_the_bare_folder_names() -> None:
    """``import core...``, ``"-m", "core.cli"`` or ``"worker.main:main"`` would load a second
    copy of a module (or work only from a checkout): every name is ``tokenrelay.``."""
    bad = []
    for path in _python_files():
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(ROOT)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value.partition(":")[0]
                names = [text] if "." in text and " " not in text and _is_our_module(text) else []
            else:
                continue
            bad += [f"{where}:{node.lineno}: {n}" for n in names if n.split(".")[0] in OLD_NAMES]
    assert not bad, "\n".join(bad)


# --- one vocabulary ----------------------------------------------------------------------
# Finish reasons, error codes, stream statuses and event kinds are the StrEnums of
# core/wire/vocabulary.py: a module that produces or compares one names the member, never
# the bare string. "stop" is also a request field and "error" a frame type: only the
# places where a string is used *as* one of these values count.


def _vocabulary() -> dict[str, set[str]]:
    from tokenrelay.core.wire.vocabulary import ErrorCode, EventKind, FinishReason, StreamStatus

    return {
        "finish reason": {str(v) for v in FinishReason},
        "error code": {str(v) for v in ErrorCode},
        "stream status": {str(v) for v in StreamStatus},
        "event kind": {str(v) for v in EventKind},
    }


VOCAB = _vocabulary()
# a compared or passed value's role, by the name it is compared with or passed as
ROLE_OF_NAME = {
    "finish_reason": ("finish reason",),
    "reason": ("finish reason",),
    "abort_reason": ("finish reason",),
    "code": ("error code", "finish reason"),  # a rejected event's code may be "cancelled"
    "status": ("stream status",),
    "kind": ("event kind",),  # Event.kind (an attribute); a bare `kind` is a frame type
}
# callables whose first argument is one of them
FIRST_ARG_ROLE = {
    **dict.fromkeys(
        (
            *("error_for_code", "error_frame", "ProtocolError", "count_error", "Refusal", "of"),
            *("Retryable", "Refused", "EngineRefused", "reject", "_refuse", "refuse"),
            "rejected_fields",
        ),
        ("error code", "finish reason"),
    ),
    **dict.fromkeys(("done_fields", "_abort", "end", "finish"), ("finish reason",)),
}
# exceptions that take an error code at any position
CODE_ANYWHERE = ("RequestError", "ResponseFormatError", "ToolError")


def _name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return None if node.id == "kind" else node.id
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "get"
        and node.args
        and isinstance(node.args[0], ast.Constant)
    ):
        return str(node.args[0].value)  # meta.get("st") ...
    return None


def _bare(node: ast.AST, roles: tuple[str, ...]) -> str | None:
    """The vocabulary word a constant (or a tuple of them) spells, if any."""
    values = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
    for v in values:
        if isinstance(v, ast.Constant) and isinstance(v.value, str) and type(v) is ast.Constant:
            for role in roles:
                if v.value in VOCAB[role]:
                    return f"{role} {v.value!r}"
    return None


def vocabulary_literals(tree: ast.AST) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            for a, b in ((x, y) for x in sides for y in sides if x is not y):
                roles = ROLE_OF_NAME.get(_name(a) or "")
                if roles and (word := _bare(b, roles)):
                    found.append((node.lineno, f"compared: {word}"))
        elif isinstance(node, ast.Call):
            for kw in node.keywords:
                roles = ROLE_OF_NAME.get(kw.arg or "")
                if roles and (word := _bare(kw.value, roles)):
                    found.append((node.lineno, f"passed as {kw.arg}: {word}"))
            func = node.func
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            roles = FIRST_ARG_ROLE.get(fname or "")
            if roles and node.args and (word := _bare(node.args[0], roles)):
                found.append((node.lineno, f"passed to {fname}: {word}"))
            if fname in CODE_ANYWHERE:
                for arg in node.args:
                    if word := _bare(arg, ("error code",)):
                        found.append((node.lineno, f"passed to {fname}: {word}"))
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = node.args.args + node.args.kwonlyargs
            defaults = [None] * (len(node.args.args) - len(node.args.defaults))
            for arg, default in zip(args, [*defaults, *node.args.defaults, *node.args.kw_defaults],
                                    strict=True):  # fmt: skip
                roles = ROLE_OF_NAME.get(arg.arg)
                if roles and default is not None and (word := _bare(default, roles)):
                    found.append((node.lineno, f"default of {arg.arg}: {word}"))
        elif isinstance(node, ast.Dict):
            if node.keys and all(isinstance(k, ast.Constant) and type(k.value) is int
                                 for k in node.keys):  # fmt: skip
                for v in node.values:  # an HTTP status -> code table
                    if word := _bare(v, ("error code",)):
                        found.append((node.lineno, f"in a status table: {word}"))
            for k, v in zip(node.keys, node.values, strict=True):
                keyed = isinstance(k, ast.Constant) and k.value in ("finish_reason", "code")
                if keyed and v is not None and (word := _bare(v, ROLE_OF_NAME[str(k.value)])):  # type: ignore[union-attr]
                    found.append((node.lineno, f"as {k.value}: {word}"))  # type: ignore[union-attr]
    return found


VOCABULARY_HOME = {f"{NS}.core.wire.vocabulary"}


@pytest.mark.parametrize("module", sorted(set(MODULES) - VOCABULARY_HOME))
def test_vocabulary_comes_from_the_enums(module: str) -> None:
    path = MODULES[module]
    found = vocabulary_literals(ast.parse(path.read_text(), str(path)))
    bad = [f"{path.relative_to(ROOT)}:{line}: {what}" for line, what in found]
    assert not bad, "use the enums of core/wire/vocabulary.py:\n" + "\n".join(bad)


def test_the_vocabulary_checker_sees_bare_strings() -> None:
    src = (
        'if ev.finish_reason == "stop": pass\n'
        'error_frame("internal", "x")\n'
        'done_fields("cancelled", 0, 0)\n'
        'x = {"code": "not_found"}\n'
        'if info.status != "done": pass\n'
        'f(reason="length")\n'
        'if ev.kind == "token": pass\n'
        'raise RequestError("too_large", "m", "f")\n'
        'def g(code="bad_request"): pass\n'
        'T = {400: "bad_request"}\n'
        # not the vocabulary: a request field, a frame type, a frame's kind
        'out["stop"] = 1\nif frame.get("type") == "error": pass\nif kind == "token": pass\n'
    )
    found = vocabulary_literals(ast.parse(src))
    assert sorted(line for line, _ in found) == list(range(1, 11)), found


def _all_imports_of(module: str) -> set[str]:
    """Like :func:`imports_of`, ``if TYPE_CHECKING:`` blocks included (type-level imports)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES)
    return {d for d in out if d in MODULES and d != module}


def test_no_import_cycles_even_for_types() -> None:
    """Parts get the collaborators they use, not the Gateway that holds them: no module the
    Gateway is built from names it back, not even in a type annotation."""
    graph = {m: _all_imports_of(m) for m in MODULES}
    state = f"{NS}.gateway.state"
    bad = sorted(m for m in graph[state] if state in graph[m])
    assert not bad, f"gateway/state.py builds these, and they import it back: {bad}"
    # only the composition root and the transports it wires take the whole Gateway
    wiring = {f"{NS}.gateway.{m}" for m in ("app", "server", "ws.connection", "grpc.service",
                                             "grpc.server", "http.openai", "http.streams",
                                             "http.common")}  # fmt: skip
    takers = sorted(m for m in graph if state in graph[m] and m not in wiring)
    assert not takers, f"these take the whole Gateway, not the parts they use: {takers}"
