"""docker/k8s/: the Kubernetes manifests validate against the schemas of a pinned Kubernetes
version (kubernetes-validate, offline) and agree with the code they run: flags, env vars,
probe paths and ports, the autoscaler's metric, the drain's time budget. And they are locked
down: unprivileged pods on read-only roots, NetworkPolicies (read here as the API server reads
them; no cluster), and a Redis that needs the password of a Secret (its start command runs
here against a real redis-server)."""

from __future__ import annotations

import argparse
import copy
import os
import re
import secrets
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import redis
import yaml

from tests.gateway.procs import free_port
from tests.root import ROOT
from tokenrelay.core.cli import build_parser
from tokenrelay.core.options import DRAIN_TIMEOUT, env_name
from tokenrelay.core.redis.embedded import find_redis_server

K8S = ROOT / "docker" / "k8s"
KUBERNETES_VERSION = "1.33.0"


def documents() -> list[tuple[str, dict[str, Any]]]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    out = []
    for name in kustomization["resources"]:
        out += [(name, doc) for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]
    return out


def find(kind: str, name: str) -> dict[str, Any]:
    for _, doc in documents():
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return doc
    raise AssertionError(f"no {kind} {name}")


def container(deployment: str) -> dict[str, Any]:
    (c,) = find("Deployment", deployment)["spec"]["template"]["spec"]["containers"]
    return dict(c)


def subcommand(command: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]  # type: ignore[no-any-return]


def test_the_kustomization_lists_every_manifest() -> None:
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}


@pytest.mark.parametrize(
    ("name", "doc"), documents(), ids=lambda v: v if isinstance(v, str) else v["kind"]
)
def test_every_object_validates(name: str, doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_validator_catches_a_mistake() -> None:
    bad = copy.deepcopy(find("Deployment", "gateway"))
    bad["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)
    bad = copy.deepcopy(find("Deployment", "worker"))
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("deployment", ["gateway", "worker"])
def test_args_and_env_are_real_flags(deployment: str) -> None:
    c = container(deployment)
    program, command, *args = c["args"]
    assert (program, command) == ("tokenrelay", deployment)
    parser = subcommand(command)
    parser.parse_args(args)  # exits on an unknown flag
    envs = {env_name(flag) for a in parser._actions for flag in a.option_strings}
    for var in c["env"]:
        assert var["name"] in envs, f"{deployment}: {var['name']} is no flag of `{command}`"


def test_gateway_probes_drain_and_autoscaler_match_the_code() -> None:
    c = container("gateway")
    port = c["ports"][0]["containerPort"]
    assert c["args"][c["args"].index("--port") + 1] == str(port)
    health = (ROOT / "gateway" / "observe" / "health.py").read_text()
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz" and '"/readyz"' in health
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz" and '"/healthz"' in health
    env = {v["name"]: v.get("value") for v in c["env"]}
    drain = float(env.get("TOKENRELAY_DRAIN_TIMEOUT", DRAIN_TIMEOUT))
    spec = find("Deployment", "gateway")["spec"]["template"]["spec"]
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert spec["terminationGracePeriodSeconds"] >= pre_stop + drain + 10
    hpa = find("HorizontalPodAutoscaler", "gateway")["spec"]
    metric = hpa["metrics"][0]["pods"]["metric"]["name"]
    metrics_src = (ROOT / "gateway" / "observe" / "metrics.py").read_text()
    assert (
        metric.startswith("tokenrelay_")
        and f'"{metric.removeprefix("tokenrelay_")}"' in metrics_src
    )
    assert find("PodDisruptionBudget", "gateway")["spec"]["minAvailable"] >= 1


def test_worker_health_port_and_gpu() -> None:
    c = container("worker")
    env = {v["name"]: v.get("value") for v in c["env"]}
    port = int(env["TOKENRELAY_HEALTH_PORT"])
    assert env["TOKENRELAY_HEALTH_HOST"] == "0.0.0.0"  # the kubelet probes the pod's address
    assert c["ports"][0]["containerPort"] == port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": c["ports"][0]["name"]}
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_redis_never_evicts_a_stream() -> None:
    (c,) = find("StatefulSet", "redis")["spec"]["template"]["spec"]["containers"]
    args = c["args"]
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    assert args[args.index("--appendonly") + 1] == "yes"


def test_the_manifests_parse_as_yaml_with_no_tabs() -> None:
    for path in K8S.glob("*.yaml"):
        assert "\t" not in Path(path).read_text(), path


def test_gateways_believe_forwarded_headers_from_the_configured_proxy_only() -> None:
    """A client's own X-Forwarded-For (127.0.0.1, say) must not make it loopback: the
    trusted proxies come from the gateway-proxy ConfigMap, never ``*``."""
    c = container("gateway")
    (var,) = [v for v in c["env"] if v["name"] == "TOKENRELAY_FORWARDED_ALLOW_IPS"]
    ref = var["valueFrom"]["configMapKeyRef"]
    trusted = find("ConfigMap", ref["name"])["data"][ref["key"]]
    assert "*" not in trusted and trusted.strip()


# --- The lockdown: unprivileged pods, NetworkPolicies, a Redis password ---------------------

WORKLOAD_KINDS = ("Deployment", "StatefulSet")
IMAGES = {"tokenrelay-cpu": "Dockerfile.cpu", "tokenrelay-cuda": "Dockerfile.cuda"}
MONITORING = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}


def workloads() -> list[dict[str, Any]]:
    return [doc for _, doc in documents() if doc["kind"] in WORKLOAD_KINDS]


def workload(name: str) -> dict[str, Any]:
    (doc,) = [w for w in workloads() if w["metadata"]["name"] == name]
    return doc


def pod(name: str) -> dict[str, Any]:
    spec: dict[str, Any] = workload(name)["spec"]["template"]["spec"]
    return spec


def containers(name: str) -> list[dict[str, Any]]:
    spec = pod(name)
    return [*spec.get("initContainers", []), *spec["containers"]]


def security(name: str, c: dict[str, Any]) -> dict[str, Any]:
    """The container's effective securityContext: its own fields over the pod's."""
    fields = ("runAsUser", "runAsGroup", "runAsNonRoot", "seccompProfile")
    inherited = {k: v for k, v in pod(name).get("securityContext", {}).items() if k in fields}
    return {**inherited, **c.get("securityContext", {})}


def writable_mounts(name: str, c: dict[str, Any]) -> set[str]:
    """Paths the container may write: read-write mounts of an emptyDir or a volume claim."""
    doc = workload(name)
    volumes = {v["name"]: v for v in pod(name).get("volumes", [])}
    claims = {t["metadata"]["name"] for t in doc["spec"].get("volumeClaimTemplates", [])}
    return {
        m["mountPath"]
        for m in c.get("volumeMounts", [])
        if not m.get("readOnly")
        and (
            m["name"] in claims
            or {"emptyDir", "persistentVolumeClaim"} & set(volumes.get(m["name"], {}))
        )
    }


def dockerfile_setting(name: str, pattern: str) -> str:
    """The last match of ``pattern`` (one group) in a Dockerfile's non-comment lines."""
    lines = (ROOT / "docker" / name).read_text().splitlines()
    text = "\n".join(ln for ln in lines if not ln.lstrip().startswith("#"))
    found = re.findall(pattern, text, re.MULTILINE)
    assert found, f"{name}: no {pattern}"
    return str(found[-1])


def env_var(c: dict[str, Any], name: str) -> dict[str, Any]:
    (var,) = [v for v in c["env"] if v["name"] == name]
    return dict(var)


@pytest.mark.parametrize("name", [w["metadata"]["name"] for w in workloads()])
def test_every_pod_runs_unprivileged_on_a_read_only_root(name: str) -> None:
    spec = pod(name)
    assert spec["automountServiceAccountToken"] is False
    fs_group = spec["securityContext"]["fsGroup"]
    assert isinstance(fs_group, int) and fs_group > 0
    assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC")
    for c in containers(name):
        sc = security(name, c)
        for field in ("runAsUser", "runAsGroup"):
            assert isinstance(sc[field], int) and sc[field] > 0, (name, c["name"], field)
        assert sc["runAsNonRoot"] is True
        assert sc["allowPrivilegeEscalation"] is False
        assert not sc.get("privileged")
        assert sc["capabilities"] == {"drop": ["ALL"]}  # and none added
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
        assert sc["readOnlyRootFilesystem"] is True
        assert writable_mounts(name, c), f"{name}/{c['name']} can write nowhere"


@pytest.mark.parametrize("name", ["gateway", "worker"])
def test_tokenrelay_pods_run_as_the_images_user_and_write_to_volumes(name: str) -> None:
    """The uid and gid are the image's own USER; $TOKENRELAY_HOME (the model cache,
    compiled kernels) and /tmp are volumes, everything else is read-only."""
    (c,) = pod(name)["containers"]
    dockerfile = IMAGES[c["image"]]
    sc = security(name, c)
    user = dockerfile_setting(dockerfile, r"^USER\s+(\S+)")
    assert user == f"{sc['runAsUser']}:{sc['runAsGroup']}", dockerfile
    assert pod(name)["securityContext"]["fsGroup"] == sc["runAsGroup"]
    home = dockerfile_setting(dockerfile, r"TOKENRELAY_HOME=(\S+)")
    assert {home, "/tmp"} <= writable_mounts(name, c)


def test_redis_runs_as_the_images_user_and_writes_only_its_data_volume() -> None:
    """redis:7.4-alpine's `redis` account is 999 in group 1000 (docker-library/redis:
    `addgroup -S -g 1000 redis; adduser -S -G redis -u 999 redis`)."""
    (c,) = pod("redis")["containers"]
    assert c["image"].startswith("redis:") and c["image"].endswith("-alpine")
    sc, fs_group = security("redis", c), pod("redis")["securityContext"]["fsGroup"]
    assert (sc["runAsUser"], sc["runAsGroup"], fs_group) == (999, 1000, 1000)
    assert writable_mounts("redis", c) == {"/data"}
    claims = workload("redis")["spec"]["volumeClaimTemplates"]
    assert [t["metadata"]["name"] for t in claims] == ["data"]


# NetworkPolicy, read the way the API server does: a policy applies to the pods its
# podSelector matches; a rule without `from` admits any source, one without `ports` any port.


def policies() -> list[dict[str, Any]]:
    return [doc for _, doc in documents() if doc["kind"] == "NetworkPolicy"]


def selects(policy: dict[str, Any], labels: dict[str, str]) -> bool:
    selector = policy["spec"]["podSelector"]
    assert set(selector) <= {"matchLabels"}, "matchExpressions: not evaluated here"
    return bool(selector.get("matchLabels", {}).items() <= labels.items())


def port_number(port: int | str, name: str) -> int:
    if isinstance(port, int):
        return port
    (number,) = [
        p["containerPort"]
        for c in containers(name)
        for p in c.get("ports", [])
        if p.get("name") == port
    ]
    return int(number)


def admitted(name: str, port: int) -> list[list[dict[str, Any]] | None]:
    """The `from` of every ingress rule that lets a connection reach ``port`` on the pods of
    workload ``name`` (None: a rule that admits any source)."""
    labels = workload(name)["spec"]["template"]["metadata"]["labels"]
    out: list[list[dict[str, Any]] | None] = []
    for policy in policies():
        if not selects(policy, labels) or "Ingress" not in policy["spec"]["policyTypes"]:
            continue
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports")
            assert not any("endPort" in p for p in ports or []), "port ranges: not evaluated"
            if ports and not any(
                "port" not in p or port_number(p["port"], name) == port for p in ports
            ):
                continue
            out.append(rule.get("from") or None)
    return out


def container_ports(name: str) -> set[int]:
    return {p["containerPort"] for c in containers(name) for p in c.get("ports", [])}


def test_ingress_is_denied_unless_a_policy_admits_it() -> None:
    deny = [p for p in policies() if p["spec"]["podSelector"] == {}]
    assert deny, "no default-deny NetworkPolicy"
    assert all(
        p["spec"]["policyTypes"] == ["Ingress"] and not p["spec"].get("ingress") for p in deny
    )
    # nothing reaches a port the pods do not serve
    for w in workloads():
        name = w["metadata"]["name"]
        assert admitted(name, 1) == [], name


def test_redis_admits_only_gateways_and_workers_on_its_port() -> None:
    (port,) = container_ports("redis")
    rules = admitted("redis", port)
    assert rules and None not in rules
    peers = [peer for rule in rules if rule is not None for peer in rule]
    # a bare podSelector: pods of this namespace only; no namespaceSelector, no ipBlock
    expected = [
        {"podSelector": {"matchLabels": workload(n)["spec"]["selector"]["matchLabels"]}}
        for n in ("gateway", "worker")
    ]
    assert sorted(peers, key=str) == sorted(expected, key=str)
    (service,) = [
        d for _, d in documents() if d["kind"] == "Service" and d["metadata"]["name"] == "redis"
    ]
    assert port_number(service["spec"]["ports"][0]["targetPort"], "redis") == port


def test_the_worker_metrics_port_admits_only_the_monitoring_namespace() -> None:
    """The worker's health port (/healthz, /metrics) is for Prometheus, from the namespace
    the docs name; the kubelet's probes come from the node, which policies never block."""
    annotations = workload("worker")["spec"]["template"]["metadata"]["annotations"]
    metrics = int(annotations["prometheus.io/port"])
    assert container_ports("worker") == {metrics}
    assert admitted("worker", metrics) == [[MONITORING]]
    docs = (ROOT / "docs" / "operations.md").read_text()
    assert "kubernetes.io/metadata.name: monitoring" in docs


def test_the_gateway_http_port_is_open_and_its_only_one() -> None:
    """Clients come through the ingress controller; /metrics shares this port."""
    annotations = workload("gateway")["spec"]["template"]["metadata"]["annotations"]
    (port,) = container_ports("gateway")
    assert int(annotations["prometheus.io/port"]) == port
    assert None in admitted("gateway", port)


# Redis: a password from a Secret; the gateways and workers get the URL from the same one.


def redis_secret() -> tuple[dict[str, str], str, str]:
    """(the Secret's data, the key of the URL, the key of the password)."""
    refs = {
        env_var(c, "TOKENRELAY_REDIS_URL")["valueFrom"]["secretKeyRef"]["name"]
        for n in ("gateway", "worker")
        for c in pod(n)["containers"]
    }
    (name,) = refs
    (url_key,) = {
        env_var(c, "TOKENRELAY_REDIS_URL")["valueFrom"]["secretKeyRef"]["key"]
        for n in ("gateway", "worker")
        for c in pod(n)["containers"]
    }
    (redis,) = pod("redis")["containers"]
    ref = env_var(redis, "REDISCLI_AUTH")["valueFrom"]["secretKeyRef"]
    assert ref["name"] == name
    return find("Secret", name)["stringData"], url_key, ref["key"]


def test_the_redis_url_comes_from_a_secret_with_the_redis_password() -> None:
    for n in ("gateway", "worker"):
        for c in pod(n)["containers"]:
            var = env_var(c, "TOKENRELAY_REDIS_URL")
            assert "value" not in var and "secretKeyRef" in var["valueFrom"], n
    data, url_key, password_key = redis_secret()
    url = urlsplit(data[url_key])
    assert url.scheme == "redis" and url.password == data[password_key]
    (service,) = [
        d for _, d in documents() if d["kind"] == "Service" and d["metadata"]["name"] == "redis"
    ]
    assert (url.hostname, url.port) == (
        service["metadata"]["name"],
        service["spec"]["ports"][0]["port"],
    )
    # the example says it is one, and its placeholder is the one Redis refuses
    text = (K8S / "redis-secret.example.yaml").read_text()
    assert text.startswith("# EXAMPLE") and data[password_key].startswith("REPLACE")


def start_redis(
    argv: list[str], password: str, folder: Path
) -> tuple[subprocess.Popen[bytes], int]:
    """Run a Redis start command of the manifests on a free loopback port (later options
    win); returns the process and the port once it answers, authenticated."""
    port = free_port()
    env = {
        "PATH": f"{Path(find_redis_server()).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "REDISCLI_AUTH": password,
    }
    argv = [*argv, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder)]
    proc = subprocess.Popen(
        argv, env=env, cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    client = redis.Redis(port=port, password=password)
    deadline = time.monotonic() + 15
    while True:
        try:
            client.ping()
            return proc, port
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(proc.communicate()[1].decode()) from None
            time.sleep(0.05)
        finally:
            client.close()


def redis_cli_check(shell: str, port: int, password: str) -> bool:
    """Whether a health check's shell line (redis-cli, the password in REDISCLI_AUTH)
    passes against the Redis on ``port``."""
    line = shell.replace("redis-cli", f"redis-cli -p {port}")
    env = {"REDISCLI_AUTH": password, "PATH": os.environ.get("PATH", "")}
    return subprocess.run(["sh", "-c", line], env=env, timeout=10).returncode == 0


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_redis_requires_the_secrets_password(tmp_path: Path) -> None:
    """The StatefulSet's own command, run here: the password comes from the environment (not
    the command line), a client without it is refused, the Secret's URL form gets in, the
    readiness probe authenticates, and the example's placeholder stops Redis."""
    (c,) = pod("redis")["containers"]
    argv = [*c["command"], *c["args"]]
    assert not any("requirepass" in a for a in argv[3:]), "a password on the command line"
    data, _, password_key = redis_secret()
    refused = subprocess.run(
        argv, env={"REDISCLI_AUTH": data[password_key], "PATH": os.environ.get("PATH", "")},
        capture_output=True, timeout=10,
    )  # fmt: skip
    assert refused.returncode != 0 and b"tokenrelay-redis" in refused.stderr
    password = secrets.token_hex(16)
    proc, port = start_redis(argv, password, tmp_path)
    try:
        cmdline = Path(f"/proc/{proc.pid}/cmdline")
        if cmdline.exists():  # what `ps` shows: redis-server itself (the shell exec'd it)
            assert password.encode() not in cmdline.read_bytes()
            assert cmdline.read_bytes().startswith(b"redis-server")
        with redis.Redis(port=port) as anonymous, pytest.raises(redis.AuthenticationError):
            anonymous.ping()
        with redis.Redis.from_url(f"redis://:{password}@127.0.0.1:{port}/0") as client:
            assert client.ping()
            assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        if shutil.which("redis-cli"):
            (shell,) = c["readinessProbe"]["exec"]["command"][2:]
            assert c["readinessProbe"]["exec"]["command"][:2] == ["sh", "-c"]
            assert redis_cli_check(shell, port, password)
            assert not redis_cli_check(shell, port, "wrong")
    finally:
        stop(proc)
