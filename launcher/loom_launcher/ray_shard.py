"""One shard rank inside a Ray actor: the actor runs `loom-shard` as its child process, exactly as
the local launcher does, and answers the driver's questions about it (its node's address, is it
ready, has it exited, its last lines). Imported by Ray workers, so it holds no driver state.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from collections import deque

from loom_proto.process import parent_pid_env

SHARD_MODULE = "loom_shard.server"
SHARD_READY_MARKER = "loom-shard ready"
NUM_LAST_LINES = 20


def free_ports(host: str, count: int) -> list[int]:
    """Distinct ports free on this node now (bound together, then released: the shard binds them a
    moment later, as vLLM's get_open_port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    probes = [socket.socket(family) for _ in range(count)]
    try:
        for probe in probes:
            probe.bind((host, 0))
        return [int(probe.getsockname()[1]) for probe in probes]
    finally:
        for probe in probes:
            probe.close()


class ShardHost:
    """Made a Ray actor by the driver (`ray.remote(ShardHost)`), one per placement-group bundle."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._process: subprocess.Popen[str] | None = None
        self._ready = threading.Event()
        self._last_lines: deque[str] = deque(maxlen=NUM_LAST_LINES)

    def node(self) -> tuple[str, str, int, int]:
        """(node id, node IP, two free ports there): where this rank serves gRPC, and where
        torch.distributed meets when this is rank 0."""
        import ray  # present wherever this runs as an actor

        ip = ray.util.get_node_ip_address()
        serve_port, rendezvous_port = free_ports(ip, 2)
        return ray.get_runtime_context().get_node_id(), ip, serve_port, rendezvous_port

    def start(self, config_json: str, secrets_json: str | None, env: dict[str, str]) -> int:
        """Starts the shard; its config JSON on the argv, the shard secret on its stdin. Returns its pid."""
        argv = [sys.executable, "-m", SHARD_MODULE, "--config-json", config_json]
        if secrets_json is not None:
            argv.append("--secrets-on-stdin")
        # The actor dies: so does its shard (the shard sets its parent-death signal itself: a Ray
        # worker runs gRPC's threads, so no preexec_fn).
        self._process = subprocess.Popen(
            argv, env={**os.environ, **env, **parent_pid_env()}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, bufsize=1, errors="replace")
        assert self._process.stdin is not None
        with self._process.stdin:
            self._process.stdin.write((secrets_json or "") + "\n")
        threading.Thread(target=self._pump, daemon=True, name=f"pump shard {self.rank}").start()
        return self._process.pid

    def _pump(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for raw in self._process.stdout:
            line = raw.rstrip("\n")
            self._last_lines.append(line)
            print(f"[shard {self.rank}] {line}", flush=True)  # Ray forwards it to the driver's log
            if line.startswith(SHARD_READY_MARKER):
                self._ready.set()

    def wait_ready(self, timeout_s: float) -> bool:
        """True once the shard printed its ready line; False when it exited or time ran out."""
        assert self._process is not None
        step = 0.2
        waited = 0.0
        while waited < timeout_s:
            if self._ready.wait(step):
                return True
            if self._process.poll() is not None:
                return False
            waited += step
        return False

    def returncode(self) -> int | None:
        """None while the shard runs."""
        return None if self._process is None else self._process.poll()

    def last_lines(self) -> list[str]:
        return list(self._last_lines)

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM, then SIGKILL after `timeout_s`; the shard's exit code."""
        process = self._process
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        return process.returncode
