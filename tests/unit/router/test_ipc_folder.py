"""The router's private folder (its ZeroMQ sockets, the metrics files): marked with its owner,
and a killed router's left behind is removed by the next router to start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from loom_router.ipc import OWNER_FILE, private_folder


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_killed_routers_folder_goes_and_the_others_stay(tmp_path: Path) -> None:
    dead = tmp_path / "loom-router-dead"
    dead.mkdir()
    (dead / OWNER_FILE).write_text(str(_dead_pid()))
    (dead / "metrics.db").write_bytes(b"x" * 100)
    live = tmp_path / "loom-router-live"
    live.mkdir()
    (live / OWNER_FILE).write_text(str(os.getpid()))
    unmarked = tmp_path / "loom-router-unmarked"  # being created, or not ours to judge
    unmarked.mkdir()
    other = tmp_path / "something-else"
    other.mkdir()
    (other / OWNER_FILE).write_text(str(_dead_pid()))

    folder = Path(private_folder(str(tmp_path)))
    assert (folder / OWNER_FILE).read_text() == str(os.getpid())
    assert not dead.exists() and live.exists() and unmarked.exists() and other.exists()
    assert oct(folder.stat().st_mode & 0o777) == "0o700"
