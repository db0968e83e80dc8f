"""Shared pieces of the HTTP benchmarks: start a launcher, stream a completion, read /metrics."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerURL(str):
    """A served base URL that knows its server's process id."""

    pid: int

    def __new__(cls, url: str, pid: int) -> ServerURL:
        self = super().__new__(cls, url)
        self.pid = pid
        return self


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """Every live process below pid (children of all its threads, recursively)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            with contextlib.suppress(OSError):
                for child in map(int, (task / "children").read_text().split()):
                    found.append(child)
                    todo.append(child)
    return found


def cpu_s(pid: int) -> float:
    """A live process's CPU seconds so far (utime + stime from /proc); 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of pid and every process below it."""
    return sum(cpu_s(p) for p in [pid, *descendants(pid)])


def machine() -> str:
    """One line naming the machine the numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


@contextlib.contextmanager
def launcher(*flags: str, timeout_s: float = 300.0, env: dict[str, str] | None = None) -> Iterator[ServerURL]:
    """Start `loom-launcher` on a free port with `flags` (and `env` added to this process's
    environment); yield its base URL."""
    port = free_port()
    uds = tempfile.mktemp(prefix="loom-bench-")
    cmd = [sys.executable, "-m", "loom_launcher.cli", "--port", str(port), "--hostname", "127.0.0.1",
           "--shard-uds-path", uds, *flags]
    with serving(cmd, port, "launcher", timeout_s, env) as url:
        yield url


@contextlib.contextmanager
def serving(cmd: list[str], port: int, name: str, timeout_s: float,
            env: dict[str, str] | None = None) -> Iterator[ServerURL]:
    """Run a server process (output to a log file; `env` added to this process's environment)
    until its /health answers 200; yield its base URL, then stop it. Raises, with the log's tail,
    when it exits or times out first."""
    log_path = Path(tempfile.mktemp(prefix=f"loom-bench-{name}-", suffix=".log"))
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, **(env or {})})
        url = ServerURL(f"http://127.0.0.1:{port}", proc.pid)
        try:
            deadline = time.monotonic() + timeout_s
            while not _healthy(url):
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name} not healthy after {timeout_s}s:\n{log_path.read_text()[-3000:]}")
                time.sleep(0.5)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _healthy(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    return False


@dataclass(slots=True)
class StreamTiming:
    ttft_s: float
    total_s: float
    num_tokens: int  # the server's usage count where it sent one, else the events that carried text
    token_times: list[float] = field(default_factory=list)  # of each event, seconds since the request was sent
    started: float = 0.0  # time.perf_counter() when the request was sent

    @property
    def inter_token_s(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


async def stream_completion(client: httpx.AsyncClient, body: dict) -> StreamTiming:
    """POST a streaming /v1/completions and time every chunk that carries a choice. A server that
    falls behind may put several tokens in one event: the token count is the final usage chunk's."""
    start = time.perf_counter()
    times: list[float] = []
    usage_tokens = None
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or "[DONE]" in line:
                continue
            event = json.loads(line[5:])
            if event["choices"]:
                times.append(time.perf_counter() - start)
            if event.get("usage"):
                usage_tokens = event["usage"]["completion_tokens"]
    total = time.perf_counter() - start
    tokens = usage_tokens if usage_tokens is not None else len(times)
    return StreamTiming(times[0] if times else total, total, tokens, times, start)


def metrics(url: str) -> dict[str, float]:
    """Scrape /metrics into {"name{labels}": value}."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[name] = float(value)
    return out


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def sustained_rate(arrivals: list[tuple[float, float]]) -> float:
    """Tokens/s between the 10th and 90th percentile of the (time, tokens) arrivals: a run without
    its ramp up (the first prefills) and its tail (the last streams alone)."""
    arrivals = sorted(arrivals)
    if len(arrivals) < 10:
        return float("nan")
    low, high = arrivals[len(arrivals) // 10][0], arrivals[len(arrivals) * 9 // 10][0]
    return sum(n for t, n in arrivals if low < t <= high) / (high - low) if high > low else float("nan")
