"""The package a pip user gets: one ``tokenrelay.`` namespace, extras by deployment.

- pyproject lists every folder with an ``__init__.py`` under its ``tokenrelay.`` name;
- the base install (the gateway, the relay worker, the Python client) has no torch,
  transformers or grpc;
  the engine, gRPC and tracing come with extras;
- a wheel built from this checkout holds only ``tokenrelay/`` (the gRPC code built in,
  the LICENSE beside its metadata), and in a fresh venv with its base dependencies
  ``tokenrelay gateway`` runs and serves while torch cannot be imported, and
  ``tokenrelay worker`` says which extra to install.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
import urllib.request
import venv
import zipfile
from pathlib import Path
from typing import Any

import pytest

from tests.root import ROOT

FOLDERS = ("core", "gateway", "worker", "engine", "client")
ENGINE_ONLY = ("torch", "transformers", "accelerate", "safetensors", "gguf", "tokenizers")


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower() for r in requirements}


def test_every_package_folder_is_listed_under_the_namespace() -> None:
    setuptools = _pyproject()["tool"]["setuptools"]
    found = {"tokenrelay.v1"}
    for folder in FOLDERS:
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT).parts
            found.add(".".join(("tokenrelay", *parts)))
    assert set(setuptools["packages"]) == found
    assert setuptools["package-dir"] == {
        **{f"tokenrelay.{f}": f for f in FOLDERS},
        "tokenrelay.v1": "proto/tokenrelay/v1",
    }
    assert _pyproject()["project"]["scripts"] == {"tokenrelay": "tokenrelay.core.cli:main"}


def test_the_base_install_is_a_gateway_and_a_relay() -> None:
    project = _pyproject()["project"]
    base = _names(project["dependencies"])
    extras = {k: _names(v) for k, v in project["optional-dependencies"].items()}
    assert not base & {*ENGINE_ONLY, "numpy", "grpcio", "grpcio-tools", "opentelemetry-sdk"}
    assert {"starlette", "uvicorn", "redis", "llguidance"} <= base
    assert "websockets" in base  # the Python client (tokenrelay.client)
    assert set(ENGINE_ONLY) <= extras["engine"]
    assert {"grpcio", "protobuf", "grpcio-health-checking"} <= extras["grpc"]
    assert "grpcio-tools" not in extras["grpc"]  # the code is generated when building
    assert "opentelemetry-sdk" in extras["tracing"]
    assert "grpcio-tools" in _names(_pyproject()["build-system"]["requires"])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of this checkout (tracked and new files), built in a copy of it: the build
    writes its build/ folder and the generated gRPC code beside the sources."""
    src = tmp_path_factory.mktemp("src")
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    for name in listed:
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
           "-q", "-w", str(out), str(src)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (whl,) = out.glob("tokenrelay-*.whl")
    return whl


def test_the_wheel_holds_one_namespace_the_grpc_code_and_the_license(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    tops = {n.split("/")[0] for n in names if "/" in n and ".dist-info/" not in n}
    assert tops == {"tokenrelay", "tokenrelay-0.1.0.data"}, tops
    for module in ("core/cli.py", "gateway/app.py", "worker/main.py", "engine/llm.py",
                   "v1/relay_pb2.py", "v1/relay_pb2_grpc.py", "engine/kernels/csrc",
                   "client/__init__.py", "client/py.typed"):  # fmt: skip
        assert any(n.startswith(f"tokenrelay/{module}") for n in names), module
    assert not any(n.startswith("tokenrelay/__init__") for n in names)  # a namespace
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "License-Expression: Apache-2.0" in meta
    base = [line for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    plain = [line for line in base if "extra ==" not in line]
    assert not [line for line in plain if any(f" {p}" in line for p in ENGINE_ONLY)], plain


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return int(r.status)
    except OSError:
        return 0


@pytest.mark.slow
def test_a_base_venv_runs_the_gateway_without_torch(
    wheel: Path, tmp_path: Path, redis_server: Any
) -> None:
    """pip installs the base dependencies from the package index (CI has it)."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py, tr = env_dir / "bin" / "python", env_dir / "bin" / "tokenrelay"
    pip = subprocess.run([str(py), "-m", "pip", "install", "-q", str(wheel)],
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    run = {"capture_output": True, "text": True, "timeout": 120, "cwd": tmp_path, "env": clean}

    assert subprocess.run([str(tr), "gateway", "--help"], **run).returncode == 0
    probe = "import torch"
    assert subprocess.run([str(py), "-c", probe], **run).returncode != 0
    client = "from tokenrelay.client import AsyncClient, Client"  # the Python client
    assert subprocess.run([str(py), "-c", client], **run).returncode == 0
    refused = subprocess.run(
        [str(tr), "worker", "--redis-url", redis_server.url, "--model", "default"], **run
    )
    assert refused.returncode == 2, refused.stderr
    assert "tokenrelay[engine]" in refused.stderr and "Traceback" not in refused.stderr

    from tests.gateway.procs import free_port

    port = free_port()
    args = [str(tr), "gateway", "--redis-url", redis_server.url, "--port", str(port),
            "--redis-prefix", "pkgtest:"]  # fmt: skip
    with (tmp_path / "gateway.log").open("wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, env=clean)
        try:
            deadline = time.monotonic() + 60
            while _get(f"http://127.0.0.1:{port}/healthz") != 200:
                assert proc.poll() is None, (tmp_path / "gateway.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "the gateway never answered /healthz"
                time.sleep(0.2)
            assert _get(f"http://127.0.0.1:{port}/") == 200  # the chat page: assets installed
        finally:
            proc.terminate()
            proc.wait(timeout=30)
