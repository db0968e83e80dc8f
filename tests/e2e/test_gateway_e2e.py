"""Two Loom replicas on loopback behind SGLang's cache-aware gateway (sglang-router, unchanged):
the gateway reads what it needs of each worker, its cache-aware policy at least doubles Loom's
own prefix-cache hit rate over round-robin on a shared-prefix workload (`loom-bench --dataset-name
shared-prefix`), and when one replica dies only the requests it held fail, with a clear error,
while the rest of the traffic goes to the other."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from tests.e2e.conftest import SERVED_MODEL, spawn_launcher, wait_healthy
from tests.net import free_port

if TYPE_CHECKING:
    from conftest import Launcher

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

# Each replica's KV holds about four of the seven prefixes: round-robin sends every prefix to both
# replicas and LRU thrashes, the cache-aware policy splits the prefixes between them.
REPLICA_ARGS = ("--max-batch-total-tokens", "1024", "--max-batch-prefill-tokens", "512")
NUM_PREFIXES, PREFIX_WORDS = 7, 180  # an odd count: round-robin cannot line prefixes up with replicas
GATEWAY_START_S = 60.0


@dataclass(slots=True)
class Gateway:
    process: subprocess.Popen[bytes]
    base_url: str
    log_path: Path

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture
def start_gateway(e2e_dir: Path) -> Iterator[Callable[..., Gateway]]:
    pytest.importorskip("sglang_router", reason="the gateway is not installed: pip install sglang-router")
    gateways: list[Gateway] = []

    def start(policy: str, worker_urls: list[str]) -> Gateway:
        port = free_port()
        log_path = e2e_dir / f"gateway-{port}.log"
        argv = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                "--worker-urls", *worker_urls, "--policy", policy, "--health-check-interval-secs", "1",
                "--health-failure-threshold", "1", "--prometheus-port", str(free_port()), "--log-level", "warn"]
        with open(log_path, "wb") as log_file:
            process = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        gateway = Gateway(process, f"http://127.0.0.1:{port}", log_path)
        gateways.append(gateway)
        wait_ready(gateway, len(worker_urls))
        return gateway

    yield start
    for gateway in gateways:
        gateway.stop()


def wait_ready(gateway: Gateway, num_workers: int) -> None:
    deadline = time.monotonic() + GATEWAY_START_S
    while time.monotonic() < deadline:
        assert gateway.process.poll() is None, gateway.log_path.read_text(errors="replace")
        try:
            ready = httpx.get(f"{gateway.base_url}/readiness", timeout=2).json()
            if ready.get("healthy_workers") == num_workers:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.25)
    raise AssertionError(f"gateway not ready: {gateway.log_path.read_text(errors='replace')}")


@pytest.fixture(scope="module")
def replicas(e2e_dir: Path) -> Iterator[list[Launcher]]:
    """Two replicas for the module's tests; the last test kills one."""
    launchers = [spawn_launcher(e2e_dir, *REPLICA_ARGS) for _ in range(2)]
    try:
        for launcher in launchers:
            wait_healthy(launcher)
        yield launchers
    finally:
        for launcher in launchers:
            launcher.stop()


def prefix_counters(replicas: list[Launcher]) -> tuple[float, float]:
    """(prompt tokens served from the prefix cache, prompt tokens computed), summed over replicas."""
    cached = computed = 0.0
    for replica in replicas:
        text = httpx.get(f"{replica.base_url}/metrics", timeout=30).text
        cached += float(re.search(r"^loom_prompt_tokens_cached_total (\S+)$", text, re.M).group(1))
        computed += float(re.search(r"^loom_prompt_tokens_computed_total (\S+)$", text, re.M).group(1))
    return cached, computed


def bench_hit_rate(gateway: Gateway, replicas: list[Launcher], seed: int, result: Path) -> float:
    """Runs the shared-prefix workload through the gateway; returns Loom's prefix-cache hit rate."""
    before = prefix_counters(replicas)
    argv = [sys.executable, "-m", "loom_bench.cli", "--backend", "openai", "--model", SERVED_MODEL, "--base-url", gateway.base_url,
            "--dataset-name", "shared-prefix", "--num-prompts", "42", "--num-prefixes", str(NUM_PREFIXES),
            "--prefix-len", str(PREFIX_WORDS), "--random-input-len", "12", "--random-output-len", "4",
            "--concurrency", "2", "--seed", str(seed), "--no-progress", "--result-file", str(result)]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(result.read_text())
    assert all(server["failed"] == 0 for run in report["runs"] for server in run["servers"].values()), run.stdout
    after = prefix_counters(replicas)
    cached, computed = after[0] - before[0], after[1] - before[1]
    return cached / (cached + computed)


def test_cache_aware_routing_at_least_doubles_the_prefix_hit_rate(
        replicas: list[Launcher], start_gateway: Callable[..., Gateway], e2e_dir: Path) -> None:
    urls = [replica.base_url for replica in replicas]
    plain = start_gateway("round_robin", urls)
    workers = httpx.get(f"{plain.base_url}/workers", timeout=10).json()["workers"]
    # It read each worker's /server_info and /model_info.
    assert all(w["is_healthy"] and w["metadata"]["model_type"] == "LlamaForCausalLM" for w in workers), workers
    round_robin = bench_hit_rate(plain, replicas, seed=1, result=e2e_dir / "rr.json")
    plain.stop()
    cache_aware = bench_hit_rate(start_gateway("cache_aware", urls), replicas, seed=2, result=e2e_dir / "ca.json")
    print(f"prefix-cache hit rate: round_robin {round_robin:.3f}, cache_aware {cache_aware:.3f}")
    assert cache_aware >= 2 * round_robin and cache_aware > 0.5, (round_robin, cache_aware)


def process_tree(pid: int) -> list[int]:
    """`pid` and every descendant, read from /proc."""
    tree, frontier = [], [pid]
    while frontier:
        current = frontier.pop()
        tree.append(current)
        try:
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except OSError:
            continue
        frontier += [int(child) for child in children]
    return tree


def completion(base_url: str, prompt: str, max_tokens: int) -> tuple[int, str]:
    body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    try:
        response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
    except httpx.HTTPError as error:
        return 0, f"{type(error).__name__}: {error}"
    return response.status_code, response.text


def wait_until_admitted(replicas: list[Launcher], num_requests: int) -> int:
    """Waits until every request is running on a replica, the first replica holding some; returns
    how many the first replica holds."""
    deadline = time.monotonic() + 120
    while True:
        loads = [httpx.get(f"{r.base_url}/get_load", timeout=10).json()[0]["num_reqs"] for r in replicas]
        if sum(loads) == num_requests and loads[0] > 0:
            return loads[0]
        assert time.monotonic() < deadline, f"requests per replica: {loads}"
        time.sleep(0.05)


def stream_completion(base_url: str, prompt: str, max_tokens: int, started: threading.Event) -> tuple[int, str]:
    """A streamed completion: (status, the last event or the transport error that ended it);
    `started` is set at its first event."""
    body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    last = ""
    try:
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.strip():
                    last = line
                    started.set()
            return response.status_code, last
    except httpx.HTTPError as error:
        return -1, f"{type(error).__name__}: {error} (after {last!r})"


def test_a_dead_replica_fails_only_its_in_flight_requests(
        replicas: list[Launcher], start_gateway: Callable[..., Gateway]) -> None:
    gateway = start_gateway("cache_aware", [replica.base_url for replica in replicas])
    victim, survivor = replicas
    prompts = [f"{word} {i}: count from one to one hundred in words:"
               for i, word in enumerate(["Apples", "Rivers", "Mountains", "Violins", "Engines", "Clouds"])]
    with ThreadPoolExecutor(len(prompts)) as pool:
        started = [threading.Event() for _ in prompts]
        in_flight = [pool.submit(stream_completion, gateway.base_url, prompt, 200, event)
                     for prompt, event in zip(prompts, started, strict=True)]
        held = wait_until_admitted(replicas, len(prompts))
        assert all(event.wait(120) for event in started)  # every stream is under way: cut mid-stream
        for pid in process_tree(victim.process.pid):  # a crash: no drain, no goodbye
            os.kill(pid, signal.SIGKILL)
        after = [completion(gateway.base_url, f"After the crash {i}: name a colour.", 8) for i in range(6)]
        before = [future.result() for future in in_flight]
    failed = [detail for status, detail in before if status != 200 or not detail.endswith("[DONE]")]
    print(f"{held} of {len(prompts)} streams on the dead replica; failed: {failed}")
    assert 1 <= len(failed) <= held, failed  # the survivor's streams finished
    for detail in failed:  # a stream cut short says so: the gateway closes it unfinished, after tokens
        assert "incomplete chunked read" in detail and "after 'data: {" in detail, detail
    assert [status for status, _ in after] == [200] * len(after), after  # new traffic: the survivor
    assert httpx.get(f"{survivor.base_url}/get_load", timeout=10).status_code == 200
