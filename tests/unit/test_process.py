"""A child that asked for it dies with the parent that started it, however that parent dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from loom_proto.process import PARENT_PID_ENV

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

CHILD = "from loom_proto.process import die_with_parent; die_with_parent(); print('ready', flush=True); " \
        "import time; time.sleep(60)"
# The parent starts the child as the frontends' supervisor does (no preexec_fn), says its pid, waits.
PARENT = f"""
import subprocess, sys, time
from loom_proto.process import parent_pid_env
from loom_proto.config import child_environment
child = subprocess.Popen([sys.executable, "-c", {CHILD!r}], env=child_environment(parent_pid_env()),
                         stdout=subprocess.PIPE, text=True)
assert child.stdout.readline() == "ready\\n"
print(child.pid, flush=True)
time.sleep(60)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"  # a zombie has died
    except FileNotFoundError:
        return False


def test_the_child_gets_sigterm_when_its_parent_is_killed() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child_pid = int(parent.stdout.readline())
    try:
        parent.kill()  # SIGKILL: the parent cleans nothing up
        parent.wait()
        deadline = time.monotonic() + 10
        while alive(child_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child_pid)
    finally:
        if alive(child_pid):
            os.kill(child_pid, signal.SIGKILL)


def test_a_child_whose_parent_is_already_gone_exits_at_once() -> None:
    env = {**os.environ, PARENT_PID_ENV: "1"}  # not its parent: the one that started it is gone
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode != 0
    assert "ready" not in done.stdout
    assert "the parent process 1 is gone" in done.stderr


def test_without_the_variable_nothing_changes() -> None:
    env = {k: v for k, v in os.environ.items() if k != PARENT_PID_ENV}
    code = "from loom_proto.process import die_with_parent; die_with_parent(); print('ok')"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30)
    assert done.stdout == "ok\n"
