"""What the tests know about the browser's files in static/: the modules, their imports, and
which of them a wheel installs (pyproject's data-files)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from tests.root import ROOT

STATIC = ROOT / "static"

# `import x from "./a.js"`, `import {a,\n b} from "./a.js"`, `export {a} from "./a.js"`,
# `import "./a.js"` at the start of a line (JSDoc lines start with `*`: never matched)
_STATIC_IMPORT = re.compile(
    r'^\s*(?:import\s+[\w*{][^;]*?\s+from|export\s+[*{][^;]*?\s+from|import)\s*"([^"]+)"',
    re.M,
)
# `import("./a.js")` with a literal, outside comments
_DYNAMIC_IMPORT = re.compile(r'\bimport\(\s*"([^"]+)"\s*\)')


def modules() -> list[Path]:
    """Our JavaScript in static/ (not the vendored libraries)."""
    return sorted(p for p in STATIC.rglob("*.js") if "vendor" not in p.relative_to(STATIC).parts)


def _code_lines(source: str) -> str:
    return "\n".join(
        line for line in source.splitlines() if not line.lstrip().startswith(("//", "*", "/*"))
    )


def _resolve(module: Path, specifier: str) -> Path | None:
    if not specifier.startswith(("./", "../")):
        return None  # a URL or a bare name: not a file of ours
    return (module.parent / specifier.split("?")[0]).resolve()


def static_imports(module: Path) -> list[Path]:
    """The files `module` imports with static import/export statements (relative ones)."""
    found = _STATIC_IMPORT.findall(module.read_text())
    return [p for p in (_resolve(module, s) for s in found) if p is not None]


def dynamic_imports(module: Path) -> list[str]:
    """The literal specifiers of `import("...")` in the code of `module` (not in comments)."""
    return _DYNAMIC_IMPORT.findall(_code_lines(module.read_text()))


def wheel_installs(path: Path) -> bool:
    """Whether pyproject's data-files put `path` (a file under static/) into a wheel, in the
    folder of share/tokenrelay/ that mirrors its own."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    data_files = project["tool"]["setuptools"]["data-files"]
    folder = "share/tokenrelay/" + path.parent.relative_to(ROOT).as_posix()
    return any(
        path.resolve() in {p.resolve() for p in ROOT.glob(g)} for g in data_files.get(folder, [])
    )
