"""The real launcher under access control, SIGTERM past the drain timeout, and a shard
killed mid-stream with two shards."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from test_snapshots_e2e import save_tiny_llama

if TYPE_CHECKING:  # conftest is pytest's to import, not ours
    from conftest import StartLauncher

pytestmark = pytest.mark.slow

API_KEY = "sk-e2e-secret-7f3a9c"
COUNTING_PROMPT = "Count from 1 to 200, separated by commas: 1, 2, 3, 4, 5,"


def stream_until_end(client: httpx.Client, url: str, body: dict[str, Any], started: threading.Event,
                     events: list[dict[str, Any]], headers: dict[str, str] | None = None) -> None:
    with client.stream("POST", url, json=body, headers=headers) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data:"):
                if line != "data: [DONE]":
                    events.append(json.loads(line[len("data:"):]))
                started.set()


def test_api_key_from_the_environment_guards_the_routes_and_shows_nowhere(
        start_launcher: StartLauncher, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOM_API_KEY", API_KEY)
    launcher = start_launcher()
    base = launcher.base_url
    assert httpx.post(f"{base}/generate", json={"inputs": "Hi"}, timeout=30).status_code == 401
    assert httpx.get(f"{base}/ready", timeout=30).status_code == 200
    response = httpx.post(f"{base}/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}},
                          headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert response.status_code == 200, response.text
    from openai import OpenAI  # the official client sends the key as a Bearer token

    models = OpenAI(base_url=f"{base}/v1", api_key=API_KEY).models.list()
    assert models.data
    for role, pid in launcher.child_pids().items():
        proc = Path(f"/proc/{pid}")
        assert API_KEY.encode() not in (proc / "cmdline").read_bytes(), role  # what `ps` shows
        assert API_KEY.encode() not in (proc / "environ").read_bytes(), role
    assert API_KEY not in launcher.log()
    assert launcher.stop() == 0


def test_sigterm_drains_then_errors_the_rest_and_every_process_exits_0(
        start_launcher: StartLauncher) -> None:
    launcher = start_launcher("--graceful-termination-timeout", "3", "--max-total-tokens", "3100")
    base = launcher.base_url
    short: list[dict[str, Any]] = []
    long: list[dict[str, Any]] = []
    started = [threading.Event(), threading.Event()]
    # The long one cannot finish within 3 s on any CPU (3000 tokens, no end of sequence); it is
    # streamed on the OpenAI route, whose error event has its own shape.
    requests = [("/generate_stream", {"inputs": COUNTING_PROMPT, "parameters": {"max_new_tokens": 8}}),
                ("/v1/completions", {"prompt": COUNTING_PROMPT, "max_tokens": 3000, "ignore_eos": True,
                                     "stream": True})]
    with httpx.Client(timeout=120) as client:
        threads = [threading.Thread(target=stream_until_end,
                                    args=(client, f"{base}{route}", body, event, events))
                   for (route, body), event, events in zip(requests, started, (short, long))]
        for thread in threads:
            thread.start()
        for event in started:
            assert event.wait(timeout=120)
        launcher.process.send_signal(signal.SIGTERM)
        ready = httpx.get(f"{base}/ready", timeout=10)
        refused = httpx.post(f"{base}/generate", json={"inputs": "Hi"}, timeout=10)
        for thread in threads:
            thread.join(timeout=60)
    assert ready.status_code == 503
    assert refused.status_code == 503 and refused.json()["error_type"] == "unavailable"
    assert short[-1]["generated_text"] is not None and len(short) == 8  # finished within the timeout
    assert "--graceful-termination-timeout" in long[-1]["error"]["message"]  # an error event, not silence
    assert launcher.wait(timeout=60) == 0
    log = launcher.log()
    assert "router exited with code 0" in log and "shard 0 exited with code 0" in log


@pytest.mark.parametrize("num_shard", [1, 2])
def test_a_shard_killed_mid_stream_ends_it_with_an_error_and_stops_the_launcher(
        start_launcher: StartLauncher, e2e_dir: Path, num_shard: int) -> None:
    # A tiny random Llama (2 kv heads) splits over 2 shards; the embedded model does not.
    model = save_tiny_llama(e2e_dir / "tiny-llama-faults")
    launcher = start_launcher("--model-id", str(model), "--dtype", "float32", "--num-shard", str(num_shard))
    base = launcher.base_url
    events: list[dict[str, Any]] = []
    started = threading.Event()
    body = {"prompt": "w1 w2 w3", "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as client:
        thread = threading.Thread(target=stream_until_end,
                                  args=(client, f"{base}/v1/completions", body, started, events))
        thread.start()
        assert started.wait(timeout=120)
        victim = f"shard {num_shard - 1}"
        os.kill(launcher.child_pids()[victim], signal.SIGKILL)
        thread.join(timeout=30)
        assert not thread.is_alive(), "the stream hung after its shard died"
        try:  # the launcher may have stopped the router already: refused, but never a hang
            status = client.post(f"{base}/v1/completions", json={"prompt": "w1"}, timeout=30).status_code
        except httpx.TransportError:
            status = None
    assert events[-1]["error"]["type"] == "server_error", events[-1]
    assert len(events) < 480
    assert status in (503, None)
    assert launcher.wait(timeout=60) != 0
    assert f"{victim} was killed by SIGKILL (code -9)" in launcher.log()
    assert launcher.log().count("loom.engine: step failed") <= 2  # no stepping into the dead shard again and again


def test_an_engine_core_killed_mid_stream_ends_it_with_an_error_and_frees_the_port_at_once(
        start_launcher: StartLauncher) -> None:
    launcher = start_launcher("--api-workers", "2")
    events: list[dict[str, Any]] = []
    started = threading.Event()
    body = {"prompt": COUNTING_PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as client:
        thread = threading.Thread(target=stream_until_end,
                                  args=(client, f"{launcher.base_url}/v1/completions", body, started, events))
        thread.start()
        assert started.wait(timeout=120)
        os.kill(launcher.child_pids()["router"], signal.SIGKILL)
        killed_at = time.monotonic()
        thread.join(timeout=30)
        assert not thread.is_alive(), "the stream hung after the engine core died"
        assert events[-1]["error"]["message"] == "the engine core stopped before this request finished", events[-1]
        assert launcher.wait(timeout=60) != 0
        while time.monotonic() - killed_at < 10:  # the frontends exit at once: nothing holds the port
            try:
                client.get(f"{launcher.base_url}/health", timeout=1)
            except httpx.TransportError:
                break
            time.sleep(0.2)
        else:
            raise AssertionError("a frontend still serves the port 10 s after the engine core died")
    assert "router was killed by SIGKILL (code -9)" in launcher.log()


def test_idle_frontends_end_cleanly_when_the_engine_core_is_killed(start_launcher: StartLauncher) -> None:
    launcher = start_launcher("--api-workers", "2")
    assert httpx.post(f"{launcher.base_url}/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}},
                      timeout=60).status_code == 200
    os.kill(launcher.child_pids()["router"], signal.SIGKILL)
    assert launcher.wait(timeout=60) != 0
    log = launcher.log()
    assert "router was killed by SIGKILL (code -9)" in log
    assert "Traceback" not in log and "CancelledError" not in log, log  # the app's shutdown ran, no force


def test_a_frozen_shard_turns_new_requests_away_at_once_and_work_resumes_when_it_thaws(
        start_launcher: StartLauncher) -> None:
    launcher = start_launcher()
    base = launcher.base_url
    events: list[dict[str, Any]] = []
    started = threading.Event()
    body = {"inputs": COUNTING_PROMPT, "parameters": {"max_new_tokens": 60}}
    shard = launcher.child_pids()["shard 0"]
    with httpx.Client(timeout=120) as client:
        thread = threading.Thread(target=stream_until_end, args=(client, f"{base}/generate_stream", body, started,
                                                                  events))
        thread.start()
        assert started.wait(timeout=120)
        os.kill(shard, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 20
            while httpx.get(f"{base}/ready", timeout=10).status_code == 200:
                assert time.monotonic() < deadline, "a frozen shard went unnoticed"
                time.sleep(0.2)
            start = time.monotonic()
            refused = httpx.post(f"{base}/generate", json={"inputs": "Hi"}, timeout=10)
            refused_in = time.monotonic() - start
            health = httpx.get(f"{base}/health", timeout=10).status_code
        finally:
            os.kill(shard, signal.SIGCONT)
        thread.join(timeout=120)
    assert refused.status_code == 503 and refused.json()["error_type"] == "unavailable", refused.text
    assert refused_in < 1.0 and health == 503
    assert not thread.is_alive() and events[-1]["generated_text"] is not None  # held, then finished
    deadline = time.monotonic() + 20
    while httpx.get(f"{base}/ready", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "the router did not take work again"
        time.sleep(0.2)
    response = httpx.post(f"{base}/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}}, timeout=60)
    assert response.status_code == 200, response.text
    assert launcher.stop() == 0
