"""A bounded soak: mixed traffic (plain and streamed generations, n > 1, streams hung up on,
shared prefixes, snapshot save/restore, bad requests) from more clients than
--max-concurrent-requests, through the real launcher. Every request gets an answer (a result,
a 429 or a 4xx, never a 5xx or a hang); afterwards no KV block is held, the router's and the
shard's file handles and threads are as before, their memory is flat, and /metrics counts
exactly the requests sent."""

from __future__ import annotations

import json
import os
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

if TYPE_CHECKING:  # conftest is pytest's to import, not ours
    from conftest import Launcher, StartLauncher

pytestmark = pytest.mark.slow

SOAK_SECONDS = 40.0  # bench/soak.py runs the same mix for 10 minutes
NUM_CLIENTS = 6
MAX_CONCURRENT = 4  # below NUM_CLIENTS: some requests must get 429
SYSTEM = "You are a terse assistant for ACME support. Answer in one short sentence."
ALLOWED = {200, 400, 404, 409, 422, 429}
MAX_RSS_GROWTH_BYTES = 64 << 20


# concurrent.futures.ThreadPoolExecutor's default size, which asyncio.to_thread uses
DEFAULT_EXECUTOR_THREADS = min(32, (os.cpu_count() or 1) + 4)


def metric_values(text: str, name: str) -> dict[str, float]:
    """`labels -> value` of one metric family in a Prometheus exposition."""
    pattern = re.compile(rf"^{name}(\{{.*\}})? (\S+)$", re.M)  # label values may hold braces
    return {labels or "": float(value) for labels, value in pattern.findall(text)}


def process_usage(pid: int) -> tuple[int, int, int]:
    """(open file handles, threads, resident bytes) of a process."""
    status = Path(f"/proc/{pid}/status").read_text()
    threads = int(re.search(r"^Threads:\s+(\d+)", status, re.M).group(1))
    rss_kb = int(re.search(r"^VmRSS:\s+(\d+)", status, re.M).group(1))
    return len(list(Path(f"/proc/{pid}/fd").iterdir())), threads, rss_kb * 1024


class Traffic:
    """One client's mix of requests; counts every request by route and answer."""

    def __init__(self, base_url: str, seed: int) -> None:
        self.client = httpx.Client(base_url=base_url, timeout=120)
        self.rng = random.Random(seed)
        self.sent: Counter[str] = Counter()  # by route template, as /metrics labels them
        self.statuses: Counter[int] = Counter()
        self.failures: list[str] = []
        self.kinds: list[Callable[[], None]] = [self.generate, self.stream, self.hang_up, self.completions_n,
                                                self.chat_shared_prefix, self.snapshot, self.bad_request]

    def run_once(self) -> None:
        self.rng.choice(self.kinds)()

    def record(self, route: str, response: httpx.Response, what: str) -> None:
        self.sent[route] += 1
        self.statuses[response.status_code] += 1
        if response.status_code not in ALLOWED:
            self.failures.append(f"{what}: {response.status_code} {response.text[:300]}")
        if response.status_code == 429:  # as a polite client does: back off a little
            time.sleep(self.rng.uniform(0.3, 1.0))

    def generate(self) -> None:
        body = {"inputs": f"Tell me about number {self.rng.randint(1, 99)}.",
                "parameters": {"max_new_tokens": self.rng.randint(1, 8)}}
        self.record("/generate", self.client.post("/generate", json=body), "generate")

    def stream(self) -> None:
        body = {"inputs": "Count: 1, 2, 3,", "parameters": {"max_new_tokens": 6, "details": True}}
        with self.client.stream("POST", "/generate_stream", json=body) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data:")]
            self.record("/generate_stream", response, "stream")
        if response.status_code == 200 and json.loads(lines[-1][5:]).get("generated_text") is None:
            self.failures.append(f"stream ended without its final event: {lines[-1][:300]}")

    def hang_up(self) -> None:
        body = {"inputs": "Write a long story about a fox.", "parameters": {"max_new_tokens": 200}}
        with self.client.stream("POST", "/generate_stream", json=body) as response:
            self.record("/generate_stream", response, "hang_up")
            for _ in zip(range(2), response.iter_lines()):
                pass  # then close the connection mid-stream

    def completions_n(self) -> None:
        body = {"prompt": "Name a colour:", "max_tokens": 4, "n": 2, "temperature": 0.9,
                "seed": self.rng.randint(0, 1000)}
        self.record("/v1/completions", self.client.post("/v1/completions", json=body), "completions n=2")

    def chat_shared_prefix(self) -> None:
        body = {"messages": [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": f"Question {self.rng.randint(1, 9)}?"}],
                "max_tokens": 4, "stream": self.rng.random() < 0.5}
        response = self.client.post("/v1/chat/completions", json=body)
        self.record("/v1/chat/completions", response, "chat")

    def snapshot(self) -> None:
        name = f"soak-{self.rng.randint(0, 2)}"
        if self.rng.random() < 0.5:
            body = {"messages": [{"role": "system", "content": SYSTEM}]}
            response = self.client.post(f"/snapshots/{name}", params={"action": "save"}, json=body)
        else:
            response = self.client.post(f"/snapshots/{name}", params={"action": "restore"})
        self.record("/snapshots/{name:any_name}", response, "snapshot")

    def bad_request(self) -> None:
        bodies = [b'{"inputs": ', b'{"inputs": "x", "parameters": {"max_new_tokens": -3}}',
                  b'{"prompt": "x", "n": 100}', b'\xff\xfe']
        path = self.rng.choice(["/generate", "/v1/completions"])
        response = self.client.post(path, content=self.rng.choice(bodies),
                                    headers={"Content-Type": "application/json"})
        self.record(path, response, "bad request")
        if response.status_code < 400:
            self.failures.append(f"a bad request was accepted: {response.text[:200]}")


def wait_idle(launcher: Launcher, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        metrics = httpx.get(f"{launcher.base_url}/metrics", timeout=30).text
        busy = (metric_values(metrics, "loom_running_requests")[""] + metric_values(metrics, "loom_queue_size")[""])
        if busy == 0 or time.monotonic() > deadline:
            return metrics
        time.sleep(0.2)


def test_mixed_traffic_above_the_concurrency_limit_leaves_nothing_behind(
        start_launcher: StartLauncher, tmp_path: Path) -> None:
    launcher = start_launcher("--max-concurrent-requests", str(MAX_CONCURRENT),
                              "--snapshot-dir", str(tmp_path / "snapshots"))
    pids = launcher.child_pids()
    warm = Traffic(launcher.base_url, seed=0)
    for kind in warm.kinds:  # every path once, so lazily made things exist before the baseline
        kind()
    warm.client.close()  # its keep-alive connection would count as the router's file handle
    wait_idle(launcher)
    before = {role: process_usage(pid) for role, pid in pids.items()}
    metrics_before = httpx.get(f"{launcher.base_url}/metrics", timeout=30).text

    clients = [Traffic(launcher.base_url, seed=1 + i) for i in range(NUM_CLIENTS)]
    stop_at = time.monotonic() + SOAK_SECONDS

    def drive(traffic: Traffic) -> None:
        while time.monotonic() < stop_at:
            try:
                traffic.run_once()
            except httpx.HTTPError as error:  # a timeout or a reset is a request left unanswered
                traffic.failures.append(f"no answer: {error!r}")

    probes: Counter[str] = Counter()

    def probe() -> None:  # liveness answers while the engine is busy; readiness stays up
        with httpx.Client(base_url=launcher.base_url, timeout=10) as client:
            while time.monotonic() < stop_at:
                for path in ("/health", "/ready"):
                    probes[f"{path} {client.get(path).status_code}"] += 1
                time.sleep(0.5)

    threads = [threading.Thread(target=drive, args=(traffic,)) for traffic in clients]
    threads.append(threading.Thread(target=probe))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=SOAK_SECONDS + 180)
    assert not any(thread.is_alive() for thread in threads), "a client hung"

    for traffic in clients:
        traffic.client.close()
    failures = [failure for traffic in clients for failure in traffic.failures]
    statuses = sum((traffic.statuses for traffic in clients), Counter())
    sent = sum((traffic.sent for traffic in clients), Counter())
    print(f"soak: {sum(statuses.values())} requests, statuses {sorted(statuses.items())}")
    assert not failures, "\n".join(failures[:20])
    assert set(probes) == {"/health 200", "/ready 200"} and probes["/health 200"] > 10, probes
    assert statuses[200] > 20 and statuses[429] > 0, statuses  # it served, and it was overloaded

    metrics = wait_idle(launcher)
    assert metric_values(metrics, "loom_kv_blocks_used")[""] == 0
    assert metric_values(metrics, "loom_running_requests")[""] == 0
    counted_before = metric_values(metrics_before, "loom_http_requests_total")
    counted = metric_values(metrics, "loom_http_requests_total")
    for route, count in sent.items():
        delta = sum(value - counted_before.get(labels, 0.0) for labels, value in counted.items()
                    if f'route="{route}"' in labels)
        assert delta == count, (route, delta, count)
    time.sleep(1.0)  # the router closes the clients' sockets once it reads their EOF
    after = {role: process_usage(pid) for role, pid in pids.items()}
    for role in pids:
        (fds0, threads0, rss0), (fds1, threads1, rss1) = before[role], after[role]
        assert fds1 <= fds0 + 2, (role, "file handles", fds0, fds1)
        # asyncio's default executor (to_thread: tokenizing, templating) grows on demand up to
        # its fixed size under concurrency; a leak would grow with the 200+ requests instead.
        assert threads1 <= threads0 + 2 + DEFAULT_EXECUTOR_THREADS, (role, "threads", threads0, threads1)
        assert rss1 - rss0 < MAX_RSS_GROWTH_BYTES, (role, "resident bytes", rss0, rss1)
    assert httpx.get(f"{launcher.base_url}/health", timeout=30).status_code == 200
