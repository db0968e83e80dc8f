"""Launcher: flags and LOOM_* variables, config building, and supervision of fake children."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import get_origin

import pytest

from loom_launcher.cli import child_env, health_url, load_settings, main, router_spec, shard_spec, threads_per_shard
from loom_launcher.supervisor import ExitStatus, ProcessSpec, serve
from loom_proto.config import (
    LauncherSettings,
    RouterConfig,
    ShardConfig,
    build_parser,
    env_var,
    option,
    parse_config,
    singular,
)
from tests.net import free_port

# One fake child for every role. argv: name notes_path mode [port].
# It notes what happens to it in notes_path, so a test can check the order of events.
FAKE_CHILD = r"""
import http.server, signal, sys, time
name, notes_path, mode = sys.argv[1], sys.argv[2], sys.argv[3]

def note(text):
    with open(notes_path, "a") as notes:
        notes.write(f"{name} {text}\n")

def on_term(*_):
    note("got SIGTERM")
    if mode == "router":
        time.sleep(0.3)  # a graceful drain takes a while
    if mode == "stubborn":
        time.sleep(60)  # a drain that would take a minute
    note("stopped")
    sys.exit(0)

signal.signal(signal.SIGTERM, on_term)
if mode == "shard":
    print("loading", flush=True)
    print(f"loom-shard ready rank=0 uds=/tmp/none", flush=True)
elif mode == "fail":
    for i in range(30):
        print(f"progress line {i}", flush=True)
    print("error: model file not found", file=sys.stderr, flush=True)
    sys.exit(2)
elif mode in ("router", "stubborn"):
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *args):
            pass
    server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[4])), Health)
    note("serving")
    server.serve_forever()
while True:  # "silent": never says it is ready
    time.sleep(0.05)
"""



def fake(name: str, notes: Path, mode: str, *extra: str) -> ProcessSpec:
    marker = "loom-shard ready" if mode not in ("router", "stubborn") else None
    return ProcessSpec(name, (sys.executable, "-c", FAKE_CHILD, name, str(notes), mode, *extra),
                       env=dict(os.environ), ready_marker=marker)


def notes_of(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


class Logs:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, line: str) -> None:
        with self.lock:
            self.lines.append(line)

    @property
    def text(self) -> str:
        with self.lock:
            return "\n".join(self.lines)


# ---- flags, environment, configs -------------------------------------------------------------

@pytest.fixture(autouse=True)
def no_loom_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("LOOM_"):
            monkeypatch.delenv(name)


def settings(*argv: str) -> LauncherSettings:
    return load_settings(list(argv))


def test_defaults_match_tgi_names() -> None:
    args = settings()
    assert (args.model_id, args.num_shard, args.hostname, args.port) == ("", 1, "0.0.0.0", 3000)
    assert args.max_concurrent_requests == 128
    assert args.max_stop_sequences == 4 and args.max_n == 16
    assert args.max_total_tokens is None and args.device == "auto"
    assert args.shard_uds_path == "/tmp/loom-server"


def test_environment_fills_flags_and_command_line_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    environ = {"LOOM_PORT": "8080", "LOOM_MAX_TOTAL_TOKENS": "512", "LOOM_MODEL_ID": "m.gguf",
               "LOOM_STARTUP_TIMEOUT": "2.5", "PORT": "1"}
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    args = settings()
    assert (args.port, args.max_total_tokens, args.model_id) == (8080, 512, "m.gguf")
    assert args.startup_timeout == 2.5
    assert settings("--port", "9000").port == 9000


def test_bad_environment_value_is_a_usage_error(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("LOOM_PORT", "http")
    with pytest.raises(SystemExit) as exit_info:
        settings()
    assert exit_info.value.code == 2
    assert "--port" in capsys.readouterr().err


def test_every_flag_has_its_variable_and_help() -> None:
    parser_help = build_parser(LauncherSettings, "loom-launcher", "").format_help()
    for name, field in LauncherSettings.model_fields.items():
        assert env_var(name) == "LOOM_" + option(name)[2:].replace("-", "_").upper()
        flag = option(singular(name)) if get_origin(field.annotation) is tuple else option(name)
        assert flag in parser_help and env_var(name) in parser_help
        assert field.description, f"{name} has no help"


def test_each_flag_is_defined_once() -> None:
    """The shard's and router's configs take their flags from the launcher's one model."""
    for config in (ShardConfig, RouterConfig):
        for name, field in config.model_fields.items():
            if name in LauncherSettings.model_fields:
                assert LauncherSettings.model_fields[name].default == field.default
                assert LauncherSettings.model_fields[name].description == field.description


def test_config_gives_each_rank_its_socket_and_splits_threads() -> None:
    args = settings("--num-shard", "2", "--shard-uds-path", "/tmp/s", "--device", "cpu",
                    "--max-batch-total-tokens", "4096")
    shards = [args.shard_config(rank) for rank in range(2)]
    assert [shard.uds_path for shard in shards] == ["/tmp/s-0", "/tmp/s-1"]
    assert [(shard.rank, shard.world_size) for shard in shards] == [(0, 2), (1, 2)]
    assert args.router_config().shard_uds_paths == ("/tmp/s-0", "/tmp/s-1")
    assert all(shard.max_batch_total_tokens == 4096 for shard in shards)
    assert args.router_config().max_batch_total_tokens == 4096
    assert threads_per_shard(args, num_cpus=8) == 4
    assert threads_per_shard(args, num_cpus=1) == 1
    assert threads_per_shard(settings("--device", "cpu", "--num-threads", "3"), num_cpus=8) == 3


def test_default_prefill_budget_follows_the_device_and_shrinks_to_a_small_kv_cache() -> None:
    def budgets(*argv: str) -> tuple[int, int]:
        config = settings(*argv, "--device", "cpu").router_config()
        return config.prefill_budget("cpu"), config.prefill_budget("cuda:0")

    assert settings("--device", "cpu").router_config().max_batch_prefill_tokens is None  # the core decides
    assert budgets() == (512, 2048)
    assert budgets("--max-batch-total-tokens", "320") == (320, 320)
    assert budgets("--max-batch-total-tokens", "9000") == (512, 2048)
    assert budgets("--max-batch-prefill-tokens", "100", "--max-batch-total-tokens", "320") == (100, 100)


def test_device_auto_is_resolved_by_the_shard_not_the_launcher() -> None:
    """The launcher never imports torch: `auto` travels to the shard, which probes."""
    assert settings().shard_config(0).device == "auto"
    assert settings("--device", "cpu").shard_config(0).device == "cpu"


@pytest.mark.parametrize("argv", [["--num-shard", "0"],
                                  ["--max-input-tokens", "512", "--max-total-tokens", "512"],
                                  ["--num-threads", "0", "--num-shard", "1"],
                                  ["--max-batch-total-tokens", "320",
                                   "--max-batch-prefill-tokens", "512"],
                                  ["--graceful-termination-timeout", "inf"], ["--startup-timeout", "inf"],
                                  ["--metrics-require-api-key", "true"]])  # no key to require
def test_invalid_combinations_are_rejected(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        settings(*argv, "--device", "cpu")
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_a_bad_flag_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--no-such-flag"], ["--port", "http"]):
        with pytest.raises(SystemExit) as exit_info:
            settings(*argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("loom-launcher: error: ") and "usage" not in err, err


def test_a_port_in_use_stops_the_launcher_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        assert main(["--hostname", "127.0.0.1", "--port", str(port), "--model-id", "/no/such/model"]) == 2
    assert time.monotonic() - start < 5  # no shard started, no model read
    assert capsys.readouterr().err == f"loom-launcher: error: cannot serve HTTP on 127.0.0.1:{port}: Address already in use\n"


def test_a_shard_socket_another_server_serves_stops_the_launcher_before_anything_starts(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    prefix = str(tmp_path / "loom")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as live:  # another launcher's shard 0
        live.bind(f"{prefix}-0.step")
        live.listen()
        start = time.monotonic()
        argv = ["--hostname", "127.0.0.1", "--port", str(free_port()), "--shard-uds-path", prefix,
                "--model-id", "/no/such/model"]
        assert main(argv) == 2
    assert time.monotonic() - start < 5  # no shard started, no model read
    err = capsys.readouterr().err
    assert err == (f"loom-launcher: error: another server's shard serves on {prefix}-0.step: give this one its own "
                   f"--shard-uds-path (now {prefix})\n")


def test_children_get_their_config_as_json() -> None:
    args = settings("--num-shard", "2", "--device", "cpu", "--port", "3100",
                    "--max-total-tokens", "512", "--master-port", "29600", "--graceful-termination-timeout", "7")
    shard = shard_spec(args.shard_config(1), {}).argv
    assert shard[1:4] == ("-m", "loom_shard.server", "--config-json")
    sent = json.loads(shard[4])
    assert sent["rank"] == 1 and sent["world_size"] == 2
    assert sent["master_port"] == 29600 and sent["uds_path"] == "/tmp/loom-server-1"
    assert sent["model_id"] == "" and sent["dtype"] is None
    router = router_spec(args.router_config(), {}).argv
    assert router[1:4] == ("-m", "loom_router.main", "--config-json")
    sent = json.loads(router[4])
    assert sent["shard_uds_paths"] == ["/tmp/loom-server-0", "/tmp/loom-server-1"]
    assert sent["port"] == 3100 and sent["max_total_tokens"] == 512
    assert sent["max_input_tokens"] is None
    assert sent["graceful_termination_timeout"] == 7.0


def test_child_env_sets_threads_and_keeps_the_rest() -> None:
    env = child_env({"PATH": "/bin", "OMP_NUM_THREADS": "64"}, num_threads=2)
    assert env["PATH"] == "/bin" and env["OMP_NUM_THREADS"] == "2"
    assert env["PYTHONUNBUFFERED"] == "1"


def test_children_get_huge_pages_unless_the_operator_set_them() -> None:
    assert child_env({}, num_threads=1)["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    assert child_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, num_threads=1)["GLIBC_TUNABLES"] \
        == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert child_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, num_threads=1)["GLIBC_TUNABLES"] \
        == "glibc.malloc.hugetlb=0"


def glibc_version() -> tuple[int, ...]:
    name, version = platform.libc_ver()
    return tuple(int(part) for part in version.split(".")) if name == "glibc" else (0,)


def test_a_child_with_the_tunable_maps_huge_pages() -> None:
    """Where THP is on (madvise or always) and glibc knows the tunable, a child's big buffer lands
    on huge pages; elsewhere the child still runs (the tunable is ignored)."""
    script = ("import re; b = bytearray(64 << 20); b[::4096] = b'x' * len(b[::4096]); "
              "print(re.search(r'AnonHugePages:\\s+(\\d+)', open('/proc/self/smaps_rollup').read()).group(1))")
    done = subprocess.run([sys.executable, "-c", script], env=child_env(os.environ, 1), capture_output=True,
                          text=True, check=True)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if "[never]" in (thp.read_text() if thp.exists() else "[never]") or glibc_version() < (2, 35):
        pytest.skip("this machine has no transparent huge pages for malloc")
    assert int(done.stdout) > 0


def test_health_url_reaches_a_wildcard_bind_on_loopback() -> None:
    assert health_url(settings("--device", "cpu", "--port", "3005").router_config()) \
        == "http://127.0.0.1:3005/health"
    assert health_url(settings("--device", "cpu", "--hostname", "10.0.0.2").router_config()) \
        == "http://10.0.0.2:3000/health"


# ---- supervision with fake children ------------------------------------------------------------

def test_shard_failing_at_startup_stops_the_others_and_shows_its_last_lines(tmp_path: Path) -> None:
    notes, logs = tmp_path / "notes", Logs()
    router = fake("router", notes, "router", str(free_port()))
    status = serve([fake("shard 0", notes, "shard"), fake("shard 1", notes, "fail")], router,
                   health_url="http://127.0.0.1:1/health", startup_timeout=30,
                   shutdown_timeout=5, stop=threading.Event(), log=logs)
    assert status == ExitStatus.CHILD_FAILED
    assert "shard 1 exited with code 2" in logs.text
    report = logs.text.split("its last lines:")[1]
    assert "error: model file not found" in report
    assert "progress line 29" in report and "progress line 5\n" not in report  # last 20 only
    assert "shard 0 stopped" in notes_of(notes)
    assert not any(line.startswith("router") for line in notes_of(notes))  # never started


def test_router_dying_while_serving_stops_the_shards(tmp_path: Path) -> None:
    notes, logs, port = tmp_path / "notes", Logs(), free_port()
    stop = threading.Event()
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(serve(
        [fake("shard 0", notes, "shard")], fake("router", notes, "router", str(port)),
        health_url=f"http://127.0.0.1:{port}/health", startup_timeout=30, shutdown_timeout=5,
        stop=stop, log=logs)))
    thread.start()
    deadline = time.monotonic() + 20
    while "Loom is serving" not in logs.text and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "Loom is serving" in logs.text
    router_pid = int(logs.text.split("started router (pid ")[1].split(")")[0])
    os.kill(router_pid, signal.SIGKILL)
    thread.join(timeout=20)
    assert result == [ExitStatus.CHILD_FAILED]
    assert "router was killed by SIGKILL (code -9)" in logs.text
    assert "shard 0 stopped" in notes_of(notes)


def test_a_shard_that_cannot_be_spawned_leaves_no_child_behind(tmp_path: Path) -> None:
    notes, logs = tmp_path / "notes", Logs()
    missing = ProcessSpec("shard 1", (str(tmp_path / "no-such-python"),), env={})
    with pytest.raises(FileNotFoundError):
        serve([fake("shard 0", notes, "shard"), missing], fake("router", notes, "router", "1"),
              health_url="http://127.0.0.1:1/health", startup_timeout=30, shutdown_timeout=5,
              stop=threading.Event(), log=logs)
    pid = int(re.findall(r"started shard 0 \(pid (\d+)\)", logs.text)[0])
    with pytest.raises(ProcessLookupError):  # stopped and reaped
        os.kill(pid, 0)


def test_readiness_timeout_is_a_clear_error(tmp_path: Path) -> None:
    notes, logs = tmp_path / "notes", Logs()
    started = time.monotonic()
    status = serve([fake("shard 0", notes, "silent")], fake("router", notes, "router", "1"),
                   health_url="http://127.0.0.1:1/health", startup_timeout=0.5,
                   shutdown_timeout=5, stop=threading.Event(), log=logs)
    assert status == ExitStatus.STARTUP_TIMEOUT
    assert time.monotonic() - started < 10
    assert "1 shard(s) not ready after" in logs.text and "0/1 reported ready" in logs.text
    assert "--startup-timeout" in logs.text
    assert "shard 0 stopped" in notes_of(notes)


DRIVER = r"""
import json, sys, threading
from loom_launcher.supervisor import ProcessSpec, install_signal_handlers, serve
shards, router, url = json.loads(sys.argv[1])
stop = threading.Event()
install_signal_handlers(stop)
sys.exit(serve([ProcessSpec(**spec) for spec in shards], ProcessSpec(**router), url,
               startup_timeout=30, shutdown_timeout=5, stop=stop))
"""


def start_driver(tmp_path: Path, notes: Path, router_mode: str = "router") -> tuple[subprocess.Popen[bytes], Path]:
    """A launcher process supervising fake children; returns once it serves."""
    port = free_port()
    specs = [fake("shard 0", notes, "shard"), fake("router", notes, router_mode, str(port))]
    as_json = [{"name": s.name, "argv": s.argv, "env": dict(s.env), "ready_marker": s.ready_marker}
               for s in specs]
    log_path = tmp_path / "launcher.log"
    with open(log_path, "w") as log_file:
        launcher = subprocess.Popen(
            [sys.executable, "-c", DRIVER,
             json.dumps([[as_json[0]], as_json[1], f"http://127.0.0.1:{port}/health"])],
            stderr=log_file, stdout=log_file)
    deadline = time.monotonic() + 20

    def serving() -> bool:  # the launcher says so, and it is our router that answered its health check
        return "Loom is serving" in log_path.read_text() and "router serving" in notes_of(notes)

    while not serving() and time.monotonic() < deadline:
        time.sleep(0.05)
    if not serving():
        launcher.kill()
        raise AssertionError(f"driver did not serve:\n{log_path.read_text()}\nnotes: {notes_of(notes)}")
    return launcher, log_path


def test_sigterm_drains_the_router_before_stopping_the_shards(tmp_path: Path) -> None:
    notes = tmp_path / "notes"
    launcher, log_path = start_driver(tmp_path, notes)
    try:
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=20) == 0
    finally:
        if launcher.poll() is None:
            launcher.kill()
    events = notes_of(notes)
    assert "received SIGTERM" in log_path.read_text()
    assert events.index("router got SIGTERM") < events.index("router stopped") \
        < events.index("shard 0 got SIGTERM")


def test_a_second_signal_kills_every_child_at_once(tmp_path: Path) -> None:
    notes = tmp_path / "notes"
    launcher, log_path = start_driver(tmp_path, notes, router_mode="stubborn")  # its drain would take 60 s
    launcher.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while "router got SIGTERM" not in notes_of(notes) and time.monotonic() < deadline:
        time.sleep(0.05)
    launcher.send_signal(signal.SIGTERM)
    again = time.monotonic()
    assert launcher.wait(timeout=10) == ExitStatus.FORCED  # not 0: requests were not drained
    assert time.monotonic() - again < 3, log_path.read_text()  # not the 5 s drain timeout, not 60 s
    log = log_path.read_text()
    assert "again: killing every process now" in log and "router killed" in log and "shard 0 killed" in log


def test_shard_server_parses_back_the_exact_config() -> None:
    from loom_shard.server import parse_config

    args = settings("--num-shard", "2", "--device", "cpu", "--dtype", "float32",
                    "--max-batch-total-tokens", "4096", "--snapshot-dir", "/tmp/snaps", "--block-size", "8")
    for rank in range(2):
        shard = args.shard_config(rank)
        assert (shard.dtype, shard.snapshot_dir, shard.block_size) == ("float32", "/tmp/snaps", 8)
        assert parse_config(list(shard_spec(shard, {}).argv[3:])) == shard


def test_router_parses_back_the_exact_config() -> None:
    from loom_router.main import DESCRIPTION

    args = settings("--num-shard", "2", "--device", "cpu", "--port", "3100", "--max-total-tokens", "512",
                    "--max-input-tokens", "300", "--served-model-name", "smol", "--snapshot-dir", "/tmp/s",
                    "--graceful-termination-timeout", "5")
    config = args.router_config()
    parsed = parse_config(RouterConfig, list(router_spec(config, {}).argv[3:]), "loom-router", DESCRIPTION)
    assert parsed == config
    assert parsed.graceful_termination_timeout == 5.0


def test_children_stop_when_the_launcher_is_killed(tmp_path: Path) -> None:
    notes = tmp_path / "notes"
    launcher, log_path = start_driver(tmp_path, notes)
    launcher.kill()  # SIGKILL: no chance to clean up
    launcher.wait()
    deadline = time.monotonic() + 10
    while len([e for e in notes_of(notes) if e.endswith("stopped")]) < 2 \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    stopped = {"shard 0 stopped", "router stopped"} <= set(notes_of(notes))
    if not stopped:  # do not leave the orphans behind
        for pid in re.findall(r"\(pid (\d+)\)", log_path.read_text()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    assert stopped, f"notes: {notes_of(notes)}\nlauncher log:\n{log_path.read_text()}"


def test_boolean_flags_are_switches_that_also_take_a_value() -> None:
    from loom_proto.config import RouterConfig, parse_config

    def json_output(*argv: str) -> bool:
        return parse_config(RouterConfig, ["--shard-uds-path", "s", *argv], "loom-router", "").json_output

    assert json_output("--json-output") is True
    assert json_output("--json-output", "true") is True
    assert json_output("--json-output", "false") is False
    assert json_output() is False


def test_json_output_lines_carry_the_level_a_plain_line_starts_with() -> None:
    from loom_launcher.supervisor import json_line

    def line(message: str) -> dict:
        return json.loads(json_line(message))

    failed = line("[shard 0] error: cannot load model /etc/passwd: not a GGUF file")
    assert (failed["level"], failed["process"], failed["target"]) == ("ERROR", "shard 0", "loom.shard")
    assert line("[launcher] error: shard 0 exited with code 2; its last lines:\n...")["level"] == "ERROR"
    assert line("[router] Traceback (most recent call last):")["level"] == "ERROR"
    assert line('[router]   File "/x/loom_router/main.py", line 3, in serve')["level"] == "ERROR"
    assert line("[router] ValueError: --max-input-tokens (9000) must be below ...")["level"] == "ERROR"
    assert line("[router] asyncio.exceptions.CancelledError")["level"] == "ERROR"
    assert line("[router] INFO:     Started server process [3]")["level"] == "INFO"
    assert line("[shard 1] warning: no C++ compiler")["level"] == "WARNING"
    assert line("[launcher] started shard 0")["level"] == "INFO"
    kept = line('[router] {"level": "ERROR", "message": "x"}')  # a child's own JSON keeps its level
    assert kept["level"] == "ERROR" and kept["process"] == "router"
