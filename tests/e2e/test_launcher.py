"""The real launcher with the embedded model: serving, graceful drain, a dying shard."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests.e2e.conftest import spawn_launcher

if TYPE_CHECKING:  # conftest is pytest's to import, not ours
    from conftest import Launcher, StartLauncher

pytestmark = pytest.mark.slow

# Greedy counting keeps the model going, so a stream is still running when SIGTERM arrives.
COUNTING_PROMPT = "Count from 1 to 200, separated by commas: 1, 2, 3, 4, 5,"


def stream_events(client: httpx.Client, base_url: str, body: dict[str, Any]) -> Any:
    with client.stream("POST", f"{base_url}/generate_stream", json=body) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data:"):
                yield json.loads(line[len("data:"):])


def test_health_and_info_report_the_launchers_limits(launcher: Launcher) -> None:
    assert httpx.get(f"{launcher.base_url}/health", timeout=10).status_code == 200
    info = httpx.get(f"{launcher.base_url}/info", timeout=10).json()
    assert info["max_total_tokens"] == 512 and info["max_input_tokens"] == 384
    assert info["max_concurrent_requests"] == 128 and info["max_batch_prefill_tokens"] == 512
    assert info["model_device_type"] == "cpu" and info["world_size"] == 1
    assert info["cpu_kernels"].split()[0] in {"avx512", "avx2"}  # the build this CPU runs
    assert "kernels " + info["cpu_kernels"].split()[0] in launcher.log()  # said once at shard start


def test_generate_through_the_launched_router(launcher: Launcher) -> None:
    body = {"inputs": COUNTING_PROMPT, "parameters": {"max_new_tokens": 4, "details": True}}
    response = httpx.post(f"{launcher.base_url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["details"]["generated_tokens"] == 4 and result["generated_text"]


def test_sigterm_lets_an_in_flight_stream_finish(start_launcher: StartLauncher) -> None:
    launcher = start_launcher()
    max_new_tokens = 48
    body = {"inputs": COUNTING_PROMPT,
            "parameters": {"max_new_tokens": max_new_tokens, "details": True}}
    events: list[dict[str, Any]] = []
    sent_at: int | None = None
    with httpx.Client(timeout=120) as client:
        for event in stream_events(client, launcher.base_url, body):
            events.append(event)
            if sent_at is None:
                launcher.process.send_signal(signal.SIGTERM)
                sent_at = len(events)
    assert sent_at == 1
    final = events[-1]
    assert final["generated_text"] is not None, "the stream ended without its final event"
    assert final["details"]["generated_tokens"] == len(events)
    assert len(events) > 1  # the stream outlived the signal
    assert launcher.wait(timeout=60) == 0
    log = launcher.log()
    assert "received SIGTERM" in log
    assert log.index("stopping router") < log.index("stopping shard 0")


def test_a_killed_shard_stops_the_launcher_with_its_last_lines(
        start_launcher: StartLauncher) -> None:
    launcher = start_launcher()
    pids = launcher.child_pids()
    assert set(pids) == {"shard 0", "router"}
    os.kill(pids["shard 0"], signal.SIGKILL)
    assert launcher.wait(timeout=60) != 0
    log = launcher.log()
    assert "shard 0 was killed by SIGKILL (code -9)" in log
    last_lines = log.split("its last lines:")[1]
    assert "loom-shard ready rank=0" in last_lines
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):
        os.kill(pids["router"], 0)  # the router was stopped too


def test_a_dtype_the_cpu_cannot_run_is_refused_at_start_in_one_line(e2e_dir: Path) -> None:
    launcher = spawn_launcher(e2e_dir, "--dtype", "float16")
    try:
        assert launcher.wait(timeout=120) != 0
    finally:
        launcher.stop()
    log = launcher.log()
    assert "[shard 0] error: --dtype float16 is not supported on CPU: Loom's CPU kernels" in log, log
    assert "Traceback" not in log and "warmup" not in log.lower()
