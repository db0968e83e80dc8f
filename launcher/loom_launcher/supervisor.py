"""Process supervision for the launcher: spawn children, pump their logs, wait, shut down.

Knows nothing of Loom's flags: it runs `ProcessSpec`s (shards first, then the router),
and `serve` returns the launcher's exit status.
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import IO

from loom_proto.process import parent_death_signal

NUM_LAST_LINES = 20
POLL_INTERVAL_S = 0.1
PROGRESS_INTERVAL_S = 5.0
SHARD_STOP_TIMEOUT_S = 10.0

Log = Callable[[str], None]


class ExitStatus(enum.IntEnum):
    OK = 0  # served and stopped on request
    CHILD_FAILED = 1  # a child died unexpectedly (during startup or while serving)
    STARTUP_TIMEOUT = 3
    FORCED = 4  # a second SIGINT/SIGTERM: every child killed, requests not drained


@dataclass(slots=True, frozen=True)
class ProcessSpec:
    name: str  # shown in log prefixes, e.g. "shard 0" or "router"
    argv: tuple[str, ...]
    env: Mapping[str, str]
    ready_marker: str | None = None  # a stdout line starting with this says "serving"
    stdin_text: str | None = None  # written to the child's stdin, then closed (secrets: not on argv)


@dataclass(slots=True)
class Child:
    spec: ProcessSpec
    process: subprocess.Popen[str]
    last_lines: deque[str] = field(default_factory=lambda: deque(maxlen=NUM_LAST_LINES))
    ready: threading.Event = field(default_factory=threading.Event)
    pump: threading.Thread | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    def last_output(self) -> str:
        """The child's last lines, after its log pump has drained the pipe (bounded wait)."""
        if self.pump is not None:
            self.pump.join(timeout=2.0)
        return "\n".join(f"  {line}" for line in self.last_lines)


class ChildExited(Exception):
    def __init__(self, child: Child) -> None:
        super().__init__(f"{child.name} {how_it_ended(child.process.returncode)}")
        self.child = child


def how_it_ended(returncode: int) -> str:
    """`exited with code N`, or for a negative code (Popen's way) the signal that killed it."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"was killed by {name} (code {returncode})"


class StartupTimeout(Exception):
    pass


class StopRequested(Exception):
    pass


def log_to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def json_log_to_stderr(message: str) -> None:
    """`--json-output`: every line one JSON object, the process it came from in `process`. A
    child's JSON line (the router's) keeps its fields; any other line becomes the message."""
    print(json_line(message), file=sys.stderr, flush=True)


def json_line(message: str) -> str:
    """'[source] text' (the launcher's and its children's lines) as a JSON object."""
    source, text = ("launcher", message)
    if message.startswith("[") and "] " in message:
        source, text = message[1:].split("] ", 1)
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        return json.dumps({**parsed, "process": source}, ensure_ascii=False)
    now = datetime.now(tz=UTC).isoformat()
    return json.dumps({"timestamp": now, "level": _level(text), "target": f"loom.{source.split()[0]}",
                       "message": text, "process": source}, ensure_ascii=False)


def _level(text: str) -> str:
    """A plain line's level, from how Loom's processes (and Python) start such lines: a
    traceback's header, its frames and its exception's line (which says why) are errors."""
    if text.startswith(("error:", "Traceback (most recent call last)", '  File "')) or EXCEPTION_LINE.match(text):
        return "ERROR"
    if text.startswith("warning:"):
        return "WARNING"
    return "INFO"


EXCEPTION_LINE = re.compile(r"[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)(: |$)")  # ValueError: ...


class ForceStop(Exception):
    """A second SIGINT/SIGTERM while stopping: every child is killed now, drained or not."""


def install_signal_handlers(stop: threading.Event, log: Log = log_to_stderr) -> None:
    """SIGINT/SIGTERM set `stop`: the supervisor then drains the router before the shards. A second
    one raises ForceStop in the main thread (as Ctrl-C raises KeyboardInterrupt): stop waiting."""

    def on_signal(signum: int, _frame: object) -> None:
        if stop.is_set():
            log(f"[launcher] received {signal.Signals(signum).name} again: killing every process now")
            raise ForceStop
        log(f"[launcher] received {signal.Signals(signum).name}, shutting down (again to stop at once)")
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)


class Supervisor:
    """Owns the child processes; every wait watches for a dead child and for a stop request."""

    def __init__(self, stop: threading.Event, log: Log = log_to_stderr) -> None:
        self.stop = stop
        self.log = log
        self.children: list[Child] = []
        self.forced = False  # a second signal: children are killed, not waited for
        self._before_exec = parent_death_signal()

    def spawn(self, spec: ProcessSpec) -> Child:
        # A new session keeps a terminal's Ctrl-C away from the children: the launcher
        # alone decides the order in which they stop.
        process = subprocess.Popen(
            spec.argv, env=dict(spec.env), stdin=subprocess.DEVNULL if spec.stdin_text is None else subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, errors="replace",
            start_new_session=True, preexec_fn=self._before_exec)
        if process.stdin is not None:
            with process.stdin:  # a few bytes: fits the pipe, never blocks
                process.stdin.write(spec.stdin_text or "")
        child = Child(spec, process)
        child.pump = threading.Thread(target=self._pump, args=(child,), daemon=True,
                                      name=f"pump {spec.name}")
        child.pump.start()
        self.children.append(child)
        self.log(f"[launcher] started {spec.name} (pid {process.pid})")
        return child

    def _pump(self, child: Child) -> None:
        stream: IO[str] | None = child.process.stdout
        assert stream is not None
        marker = child.spec.ready_marker
        for raw in stream:
            line = raw.rstrip("\n")
            child.last_lines.append(line)
            self.log(f"[{child.name}] {line}")
            if marker is not None and line.startswith(marker):
                child.ready.set()

    def check(self) -> None:
        """Raises StopRequested or ChildExited if either happened."""
        if self.stop.is_set():
            raise StopRequested()
        for child in self.children:
            if child.process.poll() is not None:
                raise ChildExited(child)

    def wait_ready(self, children: Sequence[Child], deadline: float, what: str,
                   is_ready: Callable[[], bool] | None = None) -> None:
        """Waits until every child printed its ready marker (and `is_ready()` holds).

        Prints progress every few seconds. Raises StartupTimeout, ChildExited or StopRequested.
        """
        start = time.monotonic()
        next_progress = start + PROGRESS_INTERVAL_S
        while True:
            self.check()
            num_ready = sum(child.ready.is_set() for child in children)
            counts = f", {num_ready}/{len(children)} reported ready" if children else ""
            if num_ready == len(children) and (is_ready is None or is_ready()):
                self.log(f"[launcher] {what} ready after {time.monotonic() - start:.1f}s")
                return
            now = time.monotonic()
            if now >= deadline:
                raise StartupTimeout(f"{what} not ready after {now - start:.0f}s{counts}")
            if now >= next_progress:
                self.log(f"[launcher] waiting for {what}: {now - start:.0f}s elapsed{counts}")
                next_progress += PROGRESS_INTERVAL_S
            self.stop.wait(POLL_INTERVAL_S)

    def wait_until_stop_or_exit(self) -> None:
        """Blocks while everything serves; raises StopRequested or ChildExited."""
        while True:
            self.check()
            self.stop.wait(POLL_INTERVAL_S)

    def terminate(self, children: Sequence[Child], timeout: float) -> None:
        """SIGTERM, wait up to `timeout` seconds, then SIGKILL whatever is left (at once after a
        ForceStop)."""
        running = [child for child in children if child.process.poll() is None]
        try:
            if not self.forced:
                for child in running:
                    self.log(f"[launcher] stopping {child.name}")
                    child.process.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + timeout
                for child in running:
                    try:
                        child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        self.log(f"[launcher] {child.name} did not stop in {timeout:.0f}s, killing it")
                        _kill_session(child)
                    self.log(f"[launcher] {child.name} {how_it_ended(child.process.returncode)}")
        except ForceStop:
            self.forced = True
        if self.forced:
            for child in running:
                if child.process.poll() is None:
                    _kill_session(child)
                    self.log(f"[launcher] {child.name} killed")
        for child in children:
            if child.pump is not None:
                child.pump.join(timeout=2.0)


def _kill_session(child: Child) -> None:
    """SIGKILL a child and whatever it started in its session (a router's frontends)."""
    if child.process.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.process.pid, signal.SIGKILL)  # spawned with a session of its own
    child.process.wait()


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def serve(shards: Sequence[ProcessSpec], router: ProcessSpec | None, health_url: str | None,
          startup_timeout: float, shutdown_timeout: float, stop: threading.Event,
          log: Log = log_to_stderr) -> int:
    """Starts the shards, waits for them, starts the router, supervises until stop or a death.

    Either part may be absent: a node of a multi-node deployment runs only its shards (no
    router), the router's node only the router (its shards are elsewhere). On stop the router
    goes first (it drains in-flight requests within `shutdown_timeout`), then the shards.
    Returns the launcher's exit status.
    """
    supervisor = Supervisor(stop, log)
    deadline = time.monotonic() + startup_timeout
    router_children: list[Child] = []
    status = ExitStatus.OK
    try:
        shard_children = [supervisor.spawn(spec) for spec in shards]
        if shard_children:
            supervisor.wait_ready(shard_children, deadline, f"{len(shard_children)} shard(s)")
        if router is not None and health_url is not None:
            router_children = [supervisor.spawn(router)]
            supervisor.wait_ready([], deadline, f"router at {health_url}",
                                  is_ready=lambda: http_ok(health_url))
            log(f"[launcher] Loom is serving; health at {health_url}")
        else:
            log("[launcher] this node's shards are serving; waiting for their router")
        supervisor.wait_until_stop_or_exit()
    except StopRequested:
        pass
    except ForceStop:
        supervisor.forced = True
    except ChildExited as died:
        log(f"[launcher] error: {died}; its last lines:\n{died.child.last_output()}")
        status = ExitStatus.CHILD_FAILED
    except StartupTimeout as timeout:
        log(f"[launcher] error: {timeout}; raise --startup-timeout if the model is just slow")
        status = ExitStatus.STARTUP_TIMEOUT
    finally:  # also on an unexpected error: never leave children behind
        supervisor.terminate(router_children, shutdown_timeout)
        supervisor.terminate([child for child in supervisor.children
                              if child not in router_children], SHARD_STOP_TIMEOUT_S)
    return int(ExitStatus.FORCED if supervisor.forced and status is ExitStatus.OK else status)
