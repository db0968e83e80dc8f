"""The router's frontends through the real launcher (--api-workers 2): one /metrics for every
process, and a frontend killed mid-stream: its stream's connection ends, the engine core frees
that request's KV, the frontend is started again, and the server goes on serving with the
metrics it had."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

if TYPE_CHECKING:  # conftest is pytest's to import, not ours
    from conftest import Launcher, StartLauncher

pytestmark = pytest.mark.slow

PROMPT = "Count from 1 to 200, separated by commas: 1, 2, 3, 4, 5,"


def frontend_pids(launcher: Launcher) -> list[int]:
    router = launcher.child_pids()["router"]
    children = Path(f"/proc/{router}/task/{router}/children").read_text().split()
    return [int(pid) for pid in children
            if b"loom_router.frontend.main" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def pid_serving(pids: list[int], client_port: int, server_port: int) -> int:
    """The process holding the server side of the TCP connection from `client_port`."""
    inode = None
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote = fields[1].split(":"), fields[2].split(":")
        if int(local[1], 16) == server_port and int(remote[1], 16) == client_port:
            inode = fields[9]
    assert inode is not None, "no such connection"
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                if fd.readlink().name == f"socket:[{inode}]":
                    return pid
            except OSError:
                continue
    raise AssertionError(f"no frontend holds socket {inode}")


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    assert match is not None, name
    return float(match.group(1))


def test_a_killed_frontend_frees_its_requests_kv_is_restarted_and_metrics_stay_whole(
        start_launcher: StartLauncher) -> None:
    launcher = start_launcher("--api-workers", "2", "--max-total-tokens", "2100")
    base, port = launcher.base_url, int(launcher.base_url.rsplit(":", 1)[1])
    assert len(frontend_pids(launcher)) == 2
    assert httpx.get(f"{base}/info").json()["validation_workers"] == 2  # the frontends validate
    for _ in range(6):  # new connections: the two frontends share the listening socket
        with httpx.Client(timeout=60) as client:
            assert client.post(f"{base}/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}}
                               ).status_code == 200
    assert metric(httpx.get(f"{base}/metrics").text, "tgi_request_success") == 6

    # A long stream on a raw socket (its port tells which frontend serves it).
    sock = socket.create_connection(("127.0.0.1", port))
    body = json.dumps({"prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True, "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    sock.settimeout(60)
    received = b""
    while received.count(b"data:") < 3:
        received += sock.recv(65536)
    assert metric(httpx.get(f"{base}/metrics").text, "loom_kv_blocks_used") > 0
    victim = pid_serving(frontend_pids(launcher), sock.getsockname()[1], port)
    os.kill(victim, signal.SIGKILL)

    while chunk := sock.recv(65536):  # the connection ends, without the stream's end
        received += chunk
    sock.close()
    assert b"[DONE]" not in received

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        pids = frontend_pids(launcher) if launcher.process.poll() is None else []
        if len(pids) == 2 and victim not in pids:
            break
        time.sleep(0.1)
    assert len(pids) == 2 and victim not in pids, launcher.log()  # started again
    while time.monotonic() < deadline:
        try:
            text = httpx.get(f"{base}/metrics", timeout=10).text
            if metric(text, "loom_kv_blocks_used") == 0:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    assert metric(text, "loom_kv_blocks_used") == 0  # the core freed the dead frontend's request
    assert metric(text, "tgi_request_success") == 6  # what the dead frontend counted is still there
    assert 'tgi_request_failure{err="generation"} 1.0' in text  # and the request it took with it
    for _ in range(4):
        with httpx.Client(timeout=60) as client:
            assert client.get(f"{base}/health").status_code == 200
            assert client.post(f"{base}/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}}
                               ).status_code == 200
    assert launcher.process.poll() is None
    assert "frontend" in launcher.log() and "exited with code -9" in launcher.log()
    assert "ended with it (finish_reason=error)" in launcher.log()
    assert launcher.stop() == 0
