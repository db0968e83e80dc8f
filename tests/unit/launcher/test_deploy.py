"""deploy/ and the docs that cannot run here (no Docker): syntax and cross-file agreement."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import get_origin

import yaml

from loom_launcher.cli import ROUTER_EXIT_MARGIN_S
from loom_launcher.supervisor import SHARD_STOP_TIMEOUT_S
from loom_proto.config import LauncherSettings, env_var, option, singular

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
DASHBOARD_METRICS = {
    "loom_queue_size", "loom_running_requests", "loom_kv_blocks_total", "loom_kv_blocks_used",
    "loom_kv_blocks_cached", "loom_prompt_tokens_computed_total",
    "loom_prompt_tokens_cached_total", "loom_generated_tokens_total", "loom_preemptions_total",
    "loom_swapped_bytes_total", "loom_request_duration_seconds",
    "loom_time_to_first_token_seconds", "loom_inter_token_latency_seconds",
    "loom_http_requests_total", "loom_requests_finished_total", "loom_host_blocks_total", "loom_host_blocks_used",
    "loom_shard_healthy", "loom_shard_step_seconds", "loom_shard_idle_seconds", "loom_snapshot_operations_total",
    "loom_snapshot_failures_total", "loom_steps_total", "loom_steps_planned_ahead_total",
}
# TGI's names, so the panels also read what a TGI deployment's scrape holds.
DASHBOARD_TGI_METRICS = {
    "tgi_request_success", "tgi_request_failure", "tgi_request_queue_duration", "tgi_request_inference_duration",
    "tgi_request_mean_time_per_token_duration", "tgi_batch_forward_duration", "tgi_queue_size",
    "tgi_batch_current_size", "tgi_batch_current_max_tokens", "tgi_batch_max_total_tokens",
}


def load_yaml(relative: str) -> dict:
    loaded = yaml.safe_load((DEPLOY / relative).read_text())
    assert isinstance(loaded, dict)
    return loaded


def dashboard_exprs() -> list[str]:
    dashboard = json.loads((DEPLOY / "grafana/dashboards/loom.json").read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def test_compose_runs_loom_prometheus_and_grafana() -> None:
    compose = load_yaml("docker-compose.yml")
    services = compose["services"]
    assert set(services) == {"loom", "prometheus", "grafana"}
    assert services["loom"]["build"]["dockerfile"] == "deploy/Dockerfile"
    assert "3000:3000" in services["loom"]["ports"]
    for service in ("prometheus", "grafana"):
        for volume in services[service]["volumes"]:
            source = volume.split(":")[0]
            assert (DEPLOY / source).exists(), f"{service} mounts missing {source}"
    assert all(key.startswith("LOOM_") for key in services["loom"]["environment"])
    env_vars = {env_var(name) for name in LauncherSettings.model_fields}
    assert set(services["loom"]["environment"]) <= env_vars


def test_compose_gives_the_launcher_time_to_drain_then_stop_the_shards() -> None:
    budget = LauncherSettings.model_fields["graceful_termination_timeout"].default + ROUTER_EXIT_MARGIN_S \
        + SHARD_STOP_TIMEOUT_S
    for name in ("docker-compose.yml", "docker-compose.gateway.yml"):
        services = load_yaml(name)["services"]
        for service in (s for s in services.values() if s.get("build", {}).get("dockerfile") == "deploy/Dockerfile"):
            assert float(service["stop_grace_period"].removesuffix("s")) > budget, name


def test_prometheus_scrapes_loom_metrics() -> None:
    job = load_yaml("prometheus.yml")["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == ["loom:3000"]


def test_grafana_provisioning_points_at_the_mounted_dashboards() -> None:
    datasource = load_yaml("grafana/provisioning/datasources/prometheus.yml")["datasources"][0]
    assert datasource["url"] == "http://prometheus:9090"
    provider = load_yaml("grafana/provisioning/dashboards/loom.yml")["providers"][0]
    mounts = load_yaml("docker-compose.yml")["services"]["grafana"]["volumes"]
    assert f"./grafana/dashboards:{provider['options']['path']}:ro" in mounts
    dashboard = json.loads((DEPLOY / "grafana/dashboards/loom.json").read_text())
    assert {target["datasource"]["uid"] for panel in dashboard["panels"]
            for target in panel["targets"]} == {datasource["uid"]}


def test_dashboard_covers_exactly_the_documented_metrics() -> None:
    for prefix, documented in (("loom_", DASHBOARD_METRICS), ("tgi_", DASHBOARD_TGI_METRICS)):
        used = {re.sub(r"_(bucket|sum|count)$", "", name)
                for expr in dashboard_exprs() for name in re.findall(prefix + r"\w+", expr)}
        assert used == documented


def test_dashboard_metrics_are_what_the_router_exports() -> None:
    from loom_router.observability.core_metrics import CoreMetrics
    from loom_router.observability.metrics import FrontendMetrics
    from loom_router.types import EngineStats, StepRecord

    frontend = FrontendMetrics()
    frontend.bind_limits(100, 200)
    metrics = CoreMetrics(read_stats=lambda: EngineStats(requests_finished={"length": 1}, shard_healthy=[True]))
    metrics.frontend_sources.append(frontend.registry)
    frontend.requests.labels(route="/generate", status="200").inc()
    metrics.on_step(StepRecord("prefill", True, 0.1, 0.05, [0.1]))
    frontend.snapshot_operations.labels(op="save", result="error").inc()
    frontend.snapshot_failures.labels(op="save", reason="disabled").inc()
    exposition, _ = metrics.render()
    exported = {re.sub(r"_(bucket|sum|count)$", "", line.split("{")[0].split(" ")[0])
                for line in exposition.decode().splitlines() if not line.startswith("#")}
    assert DASHBOARD_METRICS | DASHBOARD_TGI_METRICS <= exported


def test_dockerfiles_pin_the_makefiles_torch_and_run_the_launcher() -> None:
    pin = re.search(r"^TORCH \?= torch==(\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert pin is not None
    for name in ("Dockerfile", "Dockerfile.cuda"):
        text = (DEPLOY / name).read_text()
        assert f"ARG TORCH_VERSION={pin.group(1)}" in text
        assert 'ENTRYPOINT ["loom-launcher"]' in text and "EXPOSE 3000" in text
        for component in ("proto", "router", "shard", "launcher"):
            assert f"COPY {component} ./{component}" in text and f"./{component}" in text.split("pip install", 2)[2]
        assert '"./router[otel]" "./shard[otel]"' in text, "--otlp-endpoint needs the SDK in the image"
    router_only = (DEPLOY / "Dockerfile.router").read_text()
    assert '"./router[otel]"' in router_only
    assert "torch" not in router_only.split("FROM", 1)[1].replace("without torch", "")
    assert 'ENTRYPOINT ["loom-router"]' in router_only


def test_cpu_image_builds_every_isa_of_the_shards_kernels() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"apt-get install .*\bg\+\+", text), "loom_shard.kernels needs a C++ compiler"
    build = text.index("RUN python -m loom_shard.kernels")  # every ISA, at image time, failing the build
    assert text.index("ENV TORCH_EXTENSIONS_DIR=") < build < text.index("USER loom")


def test_readme_documents_every_flag_and_the_ci_command() -> None:
    readme = (ROOT / "README.md").read_text()
    rows = {line.split("|")[1].strip(" `"): line for line in readme.splitlines()
            if line.startswith("| `--")}
    flags = {name: option(singular(name)) if get_origin(field.annotation) is tuple else option(name)
             for name, field in LauncherSettings.model_fields.items()}
    assert set(rows) == set(flags.values())
    for name, field in LauncherSettings.model_fields.items():
        assert f"`{env_var(name)}`" in rows[flags[name]]
        if field.default not in (None, "", ()):  # () : a list flag given no value
            assert f"`{field.default}`" in rows[flags[name]]
    ci = (ROOT / ".ci/run").read_text()
    assert "make test" in ci and "make test" in readme and "make serve" in readme


def test_gateway_compose_puts_two_replicas_behind_the_unchanged_gateway() -> None:
    services = load_yaml("docker-compose.gateway.yml")["services"]
    replicas = {name for name, service in services.items() if service.get("build", {}).get("dockerfile")
                == "deploy/Dockerfile"}
    assert len(replicas) == 2
    gateway = services["gateway"]
    assert gateway["build"]["dockerfile"] == "deploy/Dockerfile.gateway"
    urls = gateway["command"][gateway["command"].index("--worker-urls") + 1:][:2]
    assert urls == [f"http://{name}:3000" for name in sorted(replicas)]
    assert "--policy=cache_aware" in gateway["command"]
    assert set(gateway["depends_on"]) == replicas
    env_vars = {env_var(name) for name in LauncherSettings.model_fields}
    assert all(set(services[name]["environment"]) <= env_vars for name in replicas)
    assert "pip install \"sglang-router" in (DEPLOY / "Dockerfile.gateway").read_text()


def test_gateway_manifest_discovers_the_replica_pods() -> None:
    docs = [doc for doc in yaml.safe_load_all((DEPLOY / "kubernetes/loom-gateway.yaml").read_text()) if doc]
    deployments = {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == "Deployment"}
    labels = deployments["loom-replica"]["spec"]["template"]["metadata"]["labels"]
    args = deployments["loom-gateway"]["spec"]["template"]["spec"]["containers"][0]["args"]
    selector = args[args.index("--selector") + 1]
    assert "--service-discovery" in args and selector == "=".join(next(iter(labels.items())))
    assert "--service-discovery-port=3000" in args
    role = next(doc for doc in docs if doc["kind"] == "Role")
    assert {"list", "watch"} <= set(role["rules"][0]["verbs"]) and role["rules"][0]["resources"] == ["pods"]


def test_kuberay_job_runs_the_launcher_on_ray_one_gpu_per_rank() -> None:
    docs = [doc for doc in yaml.safe_load_all((DEPLOY / "kubernetes/loom-kuberay.yaml").read_text()) if doc]
    job = next(doc for doc in docs if doc["kind"] == "RayJob")
    argv = job["spec"]["entrypoint"].split()
    settings = LauncherSettings(**{argv[i][2:].replace("-", "_"): argv[i + 1] for i in range(1, len(argv) - 1, 2)
                                   if argv[i].startswith("--")})
    assert argv[0] == "loom-launcher" and settings.placement == "ray" and settings.device == "cuda"
    workers = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    gpus = workers["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert workers["replicas"] * gpus == settings.num_shard and settings.ray_placement_strategy == "STRICT_SPREAD"
    service = next(doc for doc in docs if doc["kind"] == "Service")
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"] == head and service["spec"]["ports"][0]["port"] == settings.port
    assert "launcher[ray]" in (DEPLOY / "Dockerfile.cuda").read_text()
