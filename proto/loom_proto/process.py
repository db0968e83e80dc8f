"""What every Loom process that starts others needs: its children must not outlive it."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # linux/prctl.h
PARENT_PID_ENV = "LOOM_PARENT_PID"


def parent_death_signal() -> Callable[[], None] | None:
    """On Linux, a hook (for Popen's preexec_fn) that makes a child get SIGTERM when its parent
    dies without cleaning up (SIGKILL): children in sessions of their own are out of reach of a
    process-group kill. Resolved here, before any fork, so the hook only calls into libc."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def set_parent_death_signal() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)

    return set_parent_death_signal


def parent_pid_env() -> dict[str, str]:
    """For the environment of a child that calls `die_with_parent` first thing: this process is its
    parent. For parents with threads in native libraries (gRPC's, ZeroMQ's): Popen's preexec_fn
    makes Popen fork() such a process, and the child of that fork can deadlock or abort (gRPC's
    fork handlers) before it reaches exec; without one, Popen uses vfork, which runs no handlers."""
    return {PARENT_PID_ENV: str(os.getpid())}


def die_with_parent() -> None:
    """In a child started with `parent_pid_env`: get SIGTERM when that parent dies without cleaning
    up (Linux). A parent gone before this call ends the process at once. Elsewhere a no-op."""
    expected = os.environ.pop(PARENT_PID_ENV, None)  # not the grandchildren's
    set_signal = parent_death_signal()
    if expected is None or set_signal is None:
        return
    set_signal()
    if os.getppid() != int(expected):
        raise SystemExit(f"the parent process {expected} is gone")
