"""deploy/kubernetes: the manifests parse, their args and env are valid launcher flags, and the
probes, ports, scrape settings and shutdown budget agree with those flags."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from loom_launcher.cli import ROUTER_EXIT_MARGIN_S
from loom_launcher.supervisor import SHARD_STOP_TIMEOUT_S
from loom_proto.config import LauncherSettings, parse_config

KUBE = Path(__file__).resolve().parents[3] / "deploy" / "kubernetes"
DEPLOYMENTS = ("loom.yaml", "loom-multi-gpu.yaml")


def documents(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((KUBE / name).read_text()) if doc]


def one(name: str, kind: str) -> dict[str, Any]:
    (doc,) = [d for d in documents(name) if d["kind"] == kind]
    return doc


def settings_of(container: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> LauncherSettings:
    """What loom-launcher would run with, given the container's args and env."""
    for item in container.get("env", []):
        monkeypatch.setenv(item["name"], item["value"])
    return parse_config(LauncherSettings, container["args"], "loom-launcher", "")


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_deployment_probes_ports_and_shutdown_follow_the_flags(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    deployment = one(name, "Deployment")
    pod = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    settings = settings_of(container, monkeypatch)
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"http": settings.port, "metrics": settings.prometheus_port}
    assert settings.json_output
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(settings.prometheus_port)
    assert annotations["prometheus.io/path"] == "/metrics"
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    budget = float(command[1]) + settings.graceful_termination_timeout + ROUTER_EXIT_MARGIN_S + SHARD_STOP_TIMEOUT_S
    assert pod["spec"]["terminationGracePeriodSeconds"] >= budget
    shm = {m["name"] for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"}
    assert [v["emptyDir"]["medium"] for v in pod["spec"]["volumes"] if v["name"] in shm] == ["Memory"]


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_service_selects_the_pods_and_names_their_ports(name: str) -> None:
    service, deployment = one(name, "Service"), one(name, "Deployment")
    pod = deployment["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    container_ports = {port["name"] for port in pod["spec"]["containers"][0]["ports"]}
    assert {port["targetPort"] for port in service["spec"]["ports"]} == container_ports


def test_multi_gpu_asks_one_gpu_per_shard(monkeypatch: pytest.MonkeyPatch) -> None:
    pod = one("loom-multi-gpu.yaml", "Deployment")["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    settings = settings_of(container, monkeypatch)
    assert settings.num_shard == 2 and settings.device == "cuda"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == settings.num_shard
    model_mounts = [m["mountPath"] for m in container["volumeMounts"]]
    assert any(settings.model_id.startswith(path + "/") for path in model_mounts)


def test_service_monitor_scrapes_the_services_metrics_port() -> None:
    monitor = one("servicemonitor.yaml", "ServiceMonitor")
    (endpoint,) = monitor["spec"]["endpoints"]
    (selector,) = monitor["spec"]["selector"]["matchExpressions"]
    for name in DEPLOYMENTS:
        service = one(name, "Service")
        assert service["metadata"]["labels"]["app.kubernetes.io/name"] in selector["values"]
        assert endpoint["port"] in {port["name"] for port in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
