"""The engine core's frontend processes (`--api-workers`): started with the HTTP socket the core
bound (they share it, as uvicorn's and gunicorn's workers do), watched, and restarted when one
dies; its requests are cancelled at once (their KV freed). A frontend that keeps dying fails the
router (it exits non-zero and the launcher stops everything): a crash loop is not serving.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from loom_proto.config import FrontendConfig, RouterConfig, child_environment, public_json, secrets_json
from loom_proto.http_socket import bind_http
from loom_proto.process import parent_pid_env

log = logging.getLogger("loom.frontends")

FRONTEND_MODULE = "loom_router.frontend.main"
MAX_RESTARTS = 3  # within RESTART_WINDOW_S, per frontend; one more death fails the router
RESTART_WINDOW_S = 60.0
WATCH_INTERVAL_S = 0.2
STOP_TIMEOUT_S = 10.0
MAX_WORKERS = 8


def default_api_workers(num_cpus: int) -> int:
    """One frontend per four cores (the engine core, the shards and the OS keep the rest), 1 to 8."""
    return max(1, min(MAX_WORKERS, num_cpus // 4))


def listening_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """The HTTP socket every frontend accepts on (bound once, before any frontend starts)."""
    sock = bind_http(host, port)
    sock.listen(backlog)
    sock.setblocking(False)
    return sock


@dataclass(slots=True)
class _Frontend:
    index: int
    process: subprocess.Popen[bytes]
    deaths: deque[float] = field(default_factory=deque)


class FrontendPool:
    """Starts, watches, restarts and stops the frontends."""

    def __init__(self, config: RouterConfig, num_workers: int, folder: str, listen: socket.socket,
                 metrics_folder: str | None, on_gone: Callable[[int], None],
                 on_fatal: Callable[[str], None]) -> None:
        self._config = config
        self._num_workers = num_workers
        self._folder = folder
        self._listen = listen
        self._metrics_folder = metrics_folder
        self._on_gone = on_gone
        self._on_fatal = on_fatal
        self._frontends: dict[int, _Frontend] = {}
        self._stopping = False
        self._watch: asyncio.Task[None] | None = None

    @property
    def pids(self) -> list[int]:
        return [frontend.process.pid for frontend in self._frontends.values()]

    def start(self) -> None:
        for index in range(self._num_workers):
            self._frontends[index] = _Frontend(index, self._spawn(index))
        self._watch = asyncio.create_task(self._watch_loop(), name="loom-frontends")

    def _spawn(self, index: int) -> subprocess.Popen[bytes]:
        values = self._config.model_dump(exclude=FrontendConfig.SHARD_FIELDS) | {"api_workers": self._num_workers}
        config = FrontendConfig(**values, frontend_index=index, ipc_folder=self._folder,
                                listen_fd=self._listen.fileno(), metrics_folder=self._metrics_folder)
        argv = [sys.executable, "-m", FRONTEND_MODULE, "--config-json", public_json(config)]
        secrets = secrets_json(config)  # API keys: on stdin, never on a command line
        if secrets is not None:
            argv.append("--secrets-on-stdin")
        extra = {"PROMETHEUS_MULTIPROC_DIR": self._metrics_folder} if self._metrics_folder else {}
        # No preexec_fn: this process runs gRPC's and ZeroMQ's threads (the frontend sets its own
        # parent-death signal).
        process = subprocess.Popen(argv, stdin=subprocess.PIPE if secrets else subprocess.DEVNULL,
                                   pass_fds=(self._listen.fileno(),),
                                   env=child_environment({**extra, **parent_pid_env()}))
        if process.stdin is not None:
            with process.stdin:
                process.stdin.write((secrets or "").encode() + b"\n")
        log.info("started frontend %d (pid %d)", index, process.pid)
        return process

    async def _watch_loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(WATCH_INTERVAL_S)
            for frontend in list(self._frontends.values()):
                code = frontend.process.poll()
                if code is not None and not self._stopping:
                    self._restart(frontend, code)

    def _restart(self, frontend: _Frontend, code: int) -> None:
        log.error("frontend %d (pid %d) exited with code %d", frontend.index, frontend.process.pid, code)
        self._on_gone(frontend.index)  # its requests are cancelled, their KV freed
        now = time.monotonic()
        frontend.deaths.append(now)
        while frontend.deaths and now - frontend.deaths[0] > RESTART_WINDOW_S:
            frontend.deaths.popleft()
        if len(frontend.deaths) > MAX_RESTARTS:
            self._stopping = True
            self._on_fatal(f"frontend {frontend.index} died {len(frontend.deaths)} times in "
                           f"{RESTART_WINDOW_S:g} s (last exit code {code})")
            return
        frontend.process = self._spawn(frontend.index)

    async def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM every frontend, wait up to `timeout_s`, then SIGKILL whatever is left."""
        self._stopping = True
        if self._watch is not None:
            self._watch.cancel()
        running = [f.process for f in self._frontends.values() if f.process.poll() is None]
        for process in running:
            process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in running) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for process in running:
            if process.poll() is None:
                log.warning("frontend pid %d did not stop in %g s: killing it", process.pid, timeout_s)
                process.kill()
                process.wait()
