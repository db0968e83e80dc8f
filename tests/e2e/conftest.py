"""End-to-end fixtures: the REAL launcher (shards + router) serving the embedded model.

`launcher` is shared by a module's read-only tests; `start_launcher` gives a test its own
launcher to stop or break. Logs go to a file, printed when a test fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.net import free_port
from tests.otlp_collector import collector  # noqa: F401 (a fixture: the stand-in OTLP collector)

STARTUP_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0
# Small limits keep warmup (one step of max-batch-prefill-tokens) and the KV pool small, so a
# launcher starts quickly on 2 cores; "loom" is the `model` the tests send. A test's own flags
# win (see `launcher_argv`).
SERVED_MODEL = "loom"
SMALL_LIMITS = {"--max-total-tokens": "512", "--max-input-tokens": "384",
                "--max-batch-total-tokens": "4096", "--max-batch-prefill-tokens": "512",
                "--host-kv-cache-bytes": str(64 << 20), "--served-model-name": SERVED_MODEL}



@dataclass(slots=True)
class Launcher:
    process: subprocess.Popen[bytes]
    base_url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout=timeout)

    def stop(self) -> int | None:
        """SIGTERM (graceful), then SIGKILL of the launcher's whole session if it hangs."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        return self.process.returncode

    def child_pids(self) -> dict[str, int]:
        """The launcher's children by role ("shard 0", "router"), read from /proc."""
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        pids: dict[str, int] = {}
        for pid in map(int, children.read_text().split()):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"loom_router.main" in cmdline:
                pids["router"] = pid
            elif b"loom_shard.server" in cmdline:
                config = json.loads(cmdline[cmdline.index(b"--config-json") + 1])
                pids[f"shard {config['rank']}"] = pid
        return pids


def wait_healthy(launcher: Launcher) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if launcher.process.poll() is not None:
            raise RuntimeError(f"launcher exited with {launcher.process.returncode} before "
                               f"serving; its log:\n{launcher.log()}")
        try:
            if httpx.get(f"{launcher.base_url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    launcher.stop()
    raise RuntimeError(f"launcher not healthy after {STARTUP_TIMEOUT_S:.0f}s; its log:\n"
                       f"{launcher.log()}")


StartLauncher = Callable[..., Launcher]


@pytest.fixture(scope="session")
def e2e_dir() -> Iterator[Path]:
    # A short folder: unix socket paths must stay under ~100 bytes.
    path = Path(tempfile.mkdtemp(prefix="loom-e2e-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def started_launchers() -> list[Launcher]:
    return []


@pytest.fixture
def start_launcher(e2e_dir: Path, started_launchers: list[Launcher]) -> Iterator[StartLauncher]:
    """Starts a launcher of the test's own; every one started is stopped at teardown."""
    launchers: list[Launcher] = []

    def start(*extra_args: str, env: dict[str, str] | None = None) -> Launcher:
        launcher = spawn_launcher(e2e_dir, *extra_args, env=env)
        launchers.append(launcher)
        started_launchers.append(launcher)
        wait_healthy(launcher)
        return launcher

    yield start
    for launcher in launchers:
        launcher.stop()


def limits_for(extra_args: tuple[str, ...]) -> list[str]:
    """SMALL_LIMITS less what the test sets or what would contradict it."""
    given = dict(zip(extra_args[::2], extra_args[1::2]))  # every launcher flag takes a value
    limits = {flag: value for flag, value in SMALL_LIMITS.items() if flag not in given}
    if "--max-total-tokens" in given:
        limits.pop("--max-input-tokens", None)
    if "--max-batch-total-tokens" in given and "--max-batch-prefill-tokens" in limits:
        budget = min(int(limits["--max-batch-prefill-tokens"]), int(given["--max-batch-total-tokens"]))
        limits["--max-batch-prefill-tokens"] = str(budget)
    return [item for pair in limits.items() for item in pair]


def spawn_launcher(folder: Path, *extra_args: str, env: dict[str, str] | None = None) -> Launcher:
    """A launcher on free ports; `env` adds to this process's environment (which it passes on)."""
    port = free_port()
    name = f"l{port}"
    log_path = folder / f"{name}.log"
    argv = [sys.executable, "-m", "loom_launcher.cli", "--hostname", "127.0.0.1",
            "--port", str(port), "--master-port", str(free_port()), "--device", "cpu",
            "--shard-uds-path", str(folder / name), "--startup-timeout", str(STARTUP_TIMEOUT_S),
            *limits_for(extra_args), *extra_args]
    with open(log_path, "wb") as log_file:
        # Its own session, so a hung launcher can be killed with all its children.
        process = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True, env={**os.environ, **(env or {})})
    return Launcher(process, f"http://127.0.0.1:{port}", log_path)


@contextlib.contextmanager
def serving(folder: Path, *extra_args: str) -> Iterator[Launcher]:
    """A healthy launcher (spawn_launcher's) until the block ends, then stopped."""
    launcher = spawn_launcher(folder, *extra_args)
    try:
        wait_healthy(launcher)
        yield launcher
    finally:
        launcher.stop()


@pytest.fixture(scope="module")
def launcher(e2e_dir: Path) -> Iterator[Launcher]:
    """One launcher shared by a module's tests that do not stop or break it."""
    with serving(e2e_dir) as launcher:
        yield launcher


@pytest.fixture(scope="session")
def fp32_launcher(e2e_dir: Path) -> Iterator[Launcher]:
    """One float32 launcher for the whole session: greedy outputs then do not depend on
    what else shares the batch, so tests can compare them exactly."""
    with serving(e2e_dir, "--dtype", "float32") as launcher:
        yield launcher


@pytest.fixture(scope="module")
def server(fp32_launcher: Launcher) -> Launcher:
    return fp32_launcher


@pytest.fixture(scope="module")
def client(server: Launcher) -> openai.OpenAI:
    """The official openai client against the float32 launcher."""
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", timeout=120)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.stash[CALL_FAILED] = report.failed


CALL_FAILED = pytest.StashKey[bool]()


@pytest.fixture(autouse=True)
def print_launcher_logs_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    """On failure, the logs of every launcher the test used land in the test's report."""
    yield
    if not request.node.stash.get(CALL_FAILED, False):
        return
    used: list[Launcher] = []
    for value in request.node.funcargs.values():
        candidates = value if isinstance(value, list) else [value]
        used += [item for item in candidates if isinstance(item, Launcher) and item not in used]
    for launcher in used:
        print(f"===== launcher log {launcher.log_path} =====\n{launcher.log()}")
