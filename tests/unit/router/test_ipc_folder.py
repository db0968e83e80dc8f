"""The router's private folder (its ZeroMQ sockets, the metrics files): locked by its owner while
it lives, and a killed router's left behind is removed by the next router to start."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

from loom_router.ipc import OWNER_LOCK, private_folder

HOLD_LOCK = """
import fcntl, os, sys, time
lock = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)
fcntl.flock(lock, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(60)
"""


def _router_folder(parent: Path, name: str) -> Path:
    folder = parent / f"loom-router-{name}"
    folder.mkdir()
    (folder / OWNER_LOCK).touch()
    return folder


def test_a_killed_routers_folder_goes_and_the_others_stay(tmp_path: Path) -> None:
    dead = _router_folder(tmp_path, "dead")  # its lock died with its owner
    (dead / "metrics.db").write_bytes(b"x" * 100)
    live = _router_folder(tmp_path, "live")  # held by another process (any PID namespace)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(live / OWNER_LOCK)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        unmarked = tmp_path / "loom-router-unmarked"  # being made, or not ours to judge
        unmarked.mkdir()
        other = tmp_path / "something-else"
        other.mkdir()
        (other / OWNER_LOCK).touch()

        folder = Path(private_folder(str(tmp_path)))
        assert not dead.exists() and live.exists() and unmarked.exists() and other.exists()
        assert oct(folder.stat().st_mode & 0o777) == "0o700"
        lock = os.open(folder / OWNER_LOCK, os.O_RDWR)  # this process holds its own folder's lock
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            raise AssertionError("the new folder's lock was free")
        except BlockingIOError:
            pass
        finally:
            os.close(lock)
    finally:
        holder.kill()
        holder.wait()
    time.sleep(0.05)
    private_folder(str(tmp_path))  # the holder died: its folder is an orphan now
    assert not live.exists()
