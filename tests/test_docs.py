"""The docs hold up: the operations guide documents every command-line option and its
environment variable, and every path, link and benchmarks.md section that a doc, comment
or docstring names exists."""

from __future__ import annotations

import argparse
import ast
import functools
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

from tests.root import ROOT
from tokenrelay.core.cli import build_parser
from tokenrelay.core.options import env_name

DOC = Path(__file__).resolve().parents[1] / "docs" / "operations.md"


def test_every_flag_is_documented() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    text = DOC.read_text()
    missing = []
    for command in ("serve", "gateway", "worker"):
        for action in sub.choices[command]._actions:
            for flag in action.option_strings:
                if not flag.startswith("--") or flag == "--help":
                    continue
                if f"`{flag}`" not in text or f"`{env_name(flag)}`" not in text:
                    missing.append(f"{command} {flag}")
    assert not missing, f"undocumented in docs/operations.md: {missing}"


def test_every_environment_variable_the_code_reads_is_documented() -> None:
    """Flags carry their variable (above); this covers the rest, read straight from os.environ."""
    import re

    root = DOC.parents[1]
    text = DOC.read_text()
    names: set[str] = set()
    for pkg in ("core", "gateway", "worker", "engine"):
        for path in (root / pkg).rglob("*.py"):
            names.update(re.findall(r"[\"'](TOKENRELAY_[A-Z][A-Z_]*)[\"']", path.read_text()))
    assert "TOKENRELAY_HOME" in names  # the scan sees the code
    missing = sorted(n for n in names if f"`{n}`" not in text)
    assert not missing, f"undocumented in docs/operations.md: {missing}"


# --- Paths, links and section names the docs and comments give ------------------------

TOP_FOLDERS = (
    "core", "gateway", "worker", "engine", "client", "web", "static", "proto", "docs",
    "bench", "tests", "docker",
)  # fmt: skip
CODE_FOLDERS = ("core", "gateway", "worker", "engine", "client", "bench", "tests")
# A repository path: a top-level folder, "/", then path characters. Not when glued to a
# longer path or name ("share/tokenrelay/static/...", "$OUT/docs/...", "/tmp/bench/..."
# or "tokenrelay.engine/...": inside a wheel, a temp dir or a URL, not this tree).
PATH = re.compile(r"(?<![\w./<>${}~-])(?:" + "|".join(TOP_FOLDERS) + r")/[\w./*<>{}-]*")
# Named but not in a checkout: generated (gitignored) files and folders.
GENERATED = (
    "bench/results/",  # a bench's saved reports (bench/common.py RESULTS)
    "tests/js/node_modules",  # npm's install for the JS tests
    "proto/tokenrelay/v1/relay_pb2.py",  # setup.py builds these from relay.proto
    "proto/tokenrelay/v1/relay_pb2_grpc.py",
    "static/LICENSE",  # copied at build time
)
PLACEHOLDER = re.compile(r"[*<>{}]")  # a glob (*) or a <name> / {id} segment


def _doc_files() -> list[Path]:
    return [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]


def _code_files() -> list[Path]:
    return sorted(p for folder in CODE_FOLDERS for p in (ROOT / folder).rglob("*.py"))


@functools.cache
def _comments_and_docstrings(path: Path) -> tuple[tuple[int, str], ...]:
    """(line, text) of every comment and docstring line of a Python file."""
    source = path.read_text()
    found = [
        (tok.start[0], tok.string.lstrip("#"))
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                first = node.body[0].lineno
                found += [(first + i, line) for i, line in enumerate(doc.splitlines())]
    return tuple(found)


def _texts() -> Iterator[tuple[Path, int, str]]:
    """(file, line number, text) of the docs, and of the code's comments and docstrings."""
    for path in _doc_files():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            yield path, number, line
    for path in _code_files():
        for number, line in _comments_and_docstrings(path):
            yield path, number, line


def named_paths(text: str) -> list[str]:
    """The repository paths ``text`` names, less what is not meant to exist."""
    found = []
    for match in PATH.finditer(text):
        path = match.group(0).rstrip(".,:;")
        if PLACEHOLDER.search(path) or path.startswith(GENERATED):
            continue
        found.append(path)
    return found


def missing_paths(texts: Iterator[tuple[Path, int, str]]) -> list[str]:
    return [
        f"{where.relative_to(ROOT)}:{number}: {path}"
        for where, number, line in texts
        for path in named_paths(line)
        if not (ROOT / path).exists()
    ]


def test_the_path_scan_finds_paths_and_flags_missing_ones() -> None:
    line = "see `worker/nope.py`, docs/nope.md. and tests/engine/nope/ (engine/__init__.py)"
    assert named_paths(line) == [
        "worker/nope.py", "docs/nope.md", "tests/engine/nope/", "engine/__init__.py",
    ]  # fmt: skip
    here = ROOT / "tests" / "test_docs.py"
    assert missing_paths(iter([(here, 1, line)])) == [
        "tests/test_docs.py:1: worker/nope.py",
        "tests/test_docs.py:1: docs/nope.md",
        "tests/test_docs.py:1: tests/engine/nope/",
    ]
    skipped = "bench/results/<name> tests/*/conftest.py share/tokenrelay/static/x.js /tmp/docs/a.md"
    assert named_paths(skipped) == []


def test_every_path_a_doc_or_comment_names_exists() -> None:
    """docs/*.md, README.md, and the comments and docstrings of the Python code."""
    named = [path for _, _, line in _texts() for path in named_paths(line)]
    assert "engine/kernels/csrc/quant_matmul.c" in named  # the scan sees the code
    assert "docs/protocol.md" in named  # and the docs
    missing = missing_paths(_texts())
    assert not missing, "named but not in the repository:\n" + "\n".join(missing)


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of a Markdown file."""
    anchors = set()
    for line in path.read_text().splitlines():
        if re.match(r"#{1,6} ", line):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_relative_markdown_links_resolve() -> None:
    broken = []
    for doc in _doc_files():
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", line):
                if re.match(r"[a-z][a-z0-9+.-]*:", target):
                    continue  # https:, mailto:
                file, _, anchor = target.partition("#")
                dest = (doc.parent / file.split("?")[0]).resolve() if file else doc
                if not dest.exists():
                    broken.append(f"{doc.relative_to(ROOT)}:{number}: {target}")
                elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                    broken.append(f"{doc.relative_to(ROOT)}:{number}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_sections_of_benchmarks_md_named_elsewhere_exist() -> None:
    """A section of docs/benchmarks.md named elsewhere (its heading in quotes after the
    file's name, as the docs and comments cite it) is one of its headings."""
    bench = ROOT / "docs" / "benchmarks.md"
    headings = {
        line.lstrip("#").strip()
        for line in bench.read_text().splitlines()
        if re.match(r"#{1,6} ", line)
    }
    ref = re.compile(r"(?<![\w.-])(?:docs/)?benchmarks\.md[,:]?\s*\(?\"([^\"]+)\"")
    named, wrong = [], []
    for path in _doc_files() + _code_files():
        if path.suffix == ".py":
            text = "\n".join(line for _, line in _comments_and_docstrings(path))
        else:
            text = path.read_text()
        for heading in ref.findall(" ".join(text.split())):
            named.append(heading)
            if heading not in headings:
                wrong.append(f"{path.relative_to(ROOT)}: {heading!r}")
    assert "Grammar engine for structured outputs" in named  # the scan sees the references
    assert not wrong, f"no such heading in docs/benchmarks.md: {wrong}"


def test_the_architecture_and_protocol_docs_do_not_point_to_design_md() -> None:
    for name in ("architecture.md", "protocol.md"):
        assert "DESIGN.md" not in (ROOT / "docs" / name).read_text(), name


def test_benchmarks_md_names_every_bench_module() -> None:
    """Each bench has its section there, and each helper is named under its bench."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    modules = sorted((ROOT / "bench").glob("*.py"))
    unnamed = [p.name for p in modules if p.name != "__init__.py" and f"bench/{p.name}" not in text]
    assert not unnamed, f"not in docs/benchmarks.md: {unnamed}"
