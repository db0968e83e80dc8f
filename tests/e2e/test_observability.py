"""Observability against the real launcher: loom-bench's counts agree with /metrics (TGI names
included), its JSON parses and its PNG is one; --compare prints ratios; --json-output and
--prometheus-port work; a real Prometheus scrapes Loom through deploy/prometheus.yml's job and
every PromQL expression of the Grafana dashboard returns data."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import Launcher, StartLauncher

from tests.net import free_port
from tests.otlp_collector import Collector

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
LOOM_BENCH = Path(sys.executable).parent / "loom-bench"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})? (\S+)$")
SCRAPE_INTERVAL_S = 1
RATE_INTERVAL = "1m"  # what Grafana's $__rate_interval becomes here

pytestmark = pytest.mark.slow


def scrape(base_url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=10).text.splitlines():
        match = SAMPLE.match(line)
        if match:
            out[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return out


def run_bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(LOOM_BENCH), "--no-progress", "--random-input-len", "6", "--random-output-len", "4",
                           *args], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def totals(result: dict) -> tuple[int, int, int]:
    summaries = [s for run in result["runs"] for s in run["servers"].values()]
    return (sum(s["completed"] for s in summaries), sum(s["total_input_tokens"] for s in summaries),
            sum(s["total_output_tokens"] for s in summaries))


def test_bench_sweep_agrees_with_metrics(launcher: Launcher, tmp_path: Path) -> None:
    before = scrape(launcher.base_url)
    sweep = run_bench("--base-url", launcher.base_url, "--backend", "openai", "--ignore-eos",
                      "--concurrency", "1,2", "--num-prompts", "3", "--goodput", "ttft:60000", "tpot:60000",
                      "--result-file", str(tmp_path / "sweep.json"), "--plot", str(tmp_path / "sweep.png"))
    result = json.loads((tmp_path / "sweep.json").read_text())
    counted = [totals(result)]
    for backend in ("tgi", "openai-chat"):
        run_bench("--base-url", launcher.base_url, "--backend", backend, "--num-prompts", "2",
                  "--dataset-name", "multi-turn", "--num-turns", "2", "--result-file", str(tmp_path / "b.json"))
        counted.append(totals(json.loads((tmp_path / "b.json").read_text())))
    after = scrape(launcher.base_url)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert [run["load"]["concurrency"] for run in result["runs"]] == [1, 2]
    summary = result["runs"][0]["servers"][launcher.base_url]
    assert summary["failed"] == 0 and summary["goodput"] == pytest.approx(summary["request_throughput"])
    assert summary["total_output_tokens"] == 3 * 4  # --ignore-eos: every requested token
    assert all(summary[k]["p99"] is not None for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"))
    assert "output tok/s" in sweep.stdout
    completed, input_tokens, output_tokens = (sum(column) for column in zip(*counted))
    assert completed == 6 + 2 + 2
    assert delta("tgi_request_count") == delta("tgi_request_success") == completed
    assert delta("tgi_request_generated_tokens_sum") == delta("loom_generated_tokens_total") == output_tokens
    assert delta("tgi_request_input_length_sum") == delta("loom_request_input_tokens_sum") == input_tokens
    assert (tmp_path / "sweep.png").read_bytes().startswith(PNG_MAGIC)


def test_compare_prints_ratios_and_second_server_logs_json(launcher: Launcher, start_launcher: StartLauncher,
                                                           tmp_path: Path, collector: Collector) -> None:
    metrics_port = free_port()
    collector_url, posts = collector
    other = start_launcher("--json-output", "true", "--prometheus-port", str(metrics_port),
                           "--otlp-endpoint", collector_url)
    done = run_bench("--base-url", launcher.base_url, "--compare", other.base_url, "--num-prompts", "2",
                     "--concurrency", "1", "--result-file", str(tmp_path / "compare.json"))
    assert f"ratios {other.base_url} / {launcher.base_url}" in done.stdout
    (run,) = json.loads((tmp_path / "compare.json").read_text())["runs"]
    assert run["servers"][other.base_url]["completed"] == run["servers"][launcher.base_url]["completed"] == 2
    assert run["ratios"]["e2el_ms.mean"] > 0
    side = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    assert re.search(r"^tgi_request_success 2(\.0)?$", side, re.M), side[-2000:]
    records = [json.loads(line) for line in other.log().splitlines() if line.strip()]  # every line is JSON
    assert {"launcher", "router", "shard 0"} <= {record["process"] for record in records}
    lines = [record for record in records if record["target"] == "loom.requests"]
    assert len(lines) == 2 and all(line["fields"]["num_generated_tokens"] > 0 for line in lines)
    assert other.stop() == 0  # the router flushes its spans on the way out
    assert posts and {path for path, _ in posts} == {"/v1/traces"}


def test_the_metrics_port_asks_for_the_key_when_metrics_require_one(start_launcher: StartLauncher) -> None:
    metrics_port = free_port()
    launcher = start_launcher("--prometheus-port", str(metrics_port), "--metrics-require-api-key", "true",
                              env={"LOOM_API_KEY": "sk-metrics-key"})
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    assert httpx.get(url, timeout=10).status_code == 401
    assert httpx.get(f"{launcher.base_url}/metrics", timeout=10).status_code == 401
    keyed = httpx.get(url, headers={"Authorization": "Bearer sk-metrics-key"}, timeout=10)
    assert keyed.status_code == 200 and "tgi_request_count" in keyed.text


# ---- a real Prometheus --------------------------------------------------------------------


def find_prometheus() -> str:
    """Debian's prometheus: found, or installed with apt-get when this test may (root)."""
    found = shutil.which("prometheus")
    if found:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip("prometheus is not installed and apt-get needs root here: apt-get install prometheus")
    install = subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", "prometheus"],
                             capture_output=True, text=True, timeout=900)
    found = shutil.which("prometheus")
    if install.returncode != 0 or not found:
        pytest.skip(f"apt-get install prometheus failed: {install.stderr[-500:]}")
    return found


@pytest.fixture
def prometheus(launcher: Launcher, tmp_path: Path) -> Iterator[str]:
    """Prometheus scraping the launcher with deploy/prometheus.yml's job (its target rewritten)."""
    binary = find_prometheus()
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = config["global"]["evaluation_interval"] = f"{SCRAPE_INTERVAL_S}s"
    (job,) = config["scrape_configs"]
    job["static_configs"] = [{"targets": [launcher.base_url.removeprefix("http://")]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = open(tmp_path / "prometheus.log", "wb")
    process = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                                f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                               stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()
            time.sleep(0.25)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def query(url: str, expr: str) -> list[dict]:
    reply = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert reply["status"] == "success", (expr, reply)
    return reply["data"]["result"]


def dashboard_exprs() -> list[str]:
    dashboard = json.loads((DEPLOY / "grafana/dashboards/loom.json").read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def send_traffic(base_url: str) -> None:
    with httpx.Client(base_url=base_url, timeout=120) as client:
        for _ in range(2):
            client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 4}}).raise_for_status()
        client.post("/generate_stream", json={"inputs": "Hi", "parameters": {"max_new_tokens": 4}}).raise_for_status()
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        client.post("/v1/chat/completions", json=chat).raise_for_status()
        assert client.post("/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 0}}).status_code == 422
        assert client.post("/snapshots/s?action=save", json={"inputs": "x"}).status_code == 501  # no --snapshot-dir


def test_prometheus_evaluates_every_dashboard_expression(launcher: Launcher, prometheus: str) -> None:
    job = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())["scrape_configs"][0]["job_name"]
    deadline = time.monotonic() + 60
    while not query(prometheus, f'up{{job="{job}"}} == 1'):  # the first scrape went through
        assert time.monotonic() < deadline, "Prometheus never scraped Loom"
        time.sleep(0.5)
    send_traffic(launcher.base_url)
    expected = scrape(launcher.base_url)["tgi_request_success"]
    while not query(prometheus, f'tgi_request_success{{job="{job}"}} >= {expected}'):
        assert time.monotonic() < deadline + 60, "Prometheus never saw the traffic"
        time.sleep(0.5)
    time.sleep(3 * SCRAPE_INTERVAL_S)  # a few samples after the traffic, for rate()
    empty = [expr for expr in dashboard_exprs()
             if not query(prometheus, expr.replace("$__rate_interval", RATE_INTERVAL))]
    assert not empty, f"dashboard expressions without data: {empty}"
