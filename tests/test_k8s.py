"""docker/k8s/: the Kubernetes manifests validate against the schemas of a pinned Kubernetes
version (kubernetes-validate, offline) and agree with the code they run: flags, env vars,
probe paths and ports, the autoscaler's metric, the drain's time budget."""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.root import ROOT
from tokenrelay.core.cli import build_parser
from tokenrelay.core.options import DRAIN_TIMEOUT, env_name

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
    home = [m["mountPath"] for m in c["volumeMounts"]]
    dockerfile = (ROOT / "docker" / "Dockerfile.cuda").read_text()
    assert all(f"TOKENRELAY_HOME={path}" in dockerfile for path in home)


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
