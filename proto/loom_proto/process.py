"""What every Loom process that starts others needs: its children must not outlive it."""

from __future__ import annotations

import ctypes
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # linux/prctl.h


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
