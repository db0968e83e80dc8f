"""ZeroMQ plumbing of the frontend/engine-core contract (loom_router.contract), on the event loop:
a PULL socket read from a reader callback (every waiting message at once, no task per message),
and PUSH sockets that never block the loop: what the peer cannot take yet waits, in order, and
goes as soon as the socket is writable again (its file descriptor says so)."""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import shutil
import tempfile
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

log = logging.getLogger("loom.ipc")

RETRY_S = 0.05  # a backlogged sender also retries on a timer (a missed edge of the socket's fd)


def ipc_address(folder: str, name: str) -> str:
    return f"ipc://{os.path.join(folder, name)}"


FOLDER_PREFIX = "loom-router-"
OWNER_LOCK = "owner.lock"
_held_locks: dict[str, int] = {}  # this process's folders and their locks, held until removed


def private_folder(parent: str | None = None) -> str:
    """A folder for the router's sockets, readable by this user only (short: unix socket paths
    are limited to ~107 bytes), locked by this process while it lives. The folders of routers
    that were killed (SIGKILL leaves them: their locks went with them) are removed first."""
    parent = parent or tempfile.gettempdir()
    remove_orphaned_folders(parent)
    folder = tempfile.mkdtemp(prefix=FOLDER_PREFIX, dir=parent)
    lock = os.open(os.path.join(folder, OWNER_LOCK), os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    _held_locks[folder] = lock
    return folder


def remove_orphaned_folders(parent: str) -> None:
    """Remove the router folders under parent that no live process holds locked (a lock, unlike
    a process id, means the same in every PID namespace that shares the folder)."""
    for name in os.listdir(parent):
        folder = os.path.join(parent, name)
        if name.startswith(FOLDER_PREFIX) and _orphaned(folder):
            remove_folder(folder)


def _orphaned(folder: str) -> bool:
    """Whether the folder's lock can be taken: its owner is gone. A folder without one (being
    made, or not a router's of this kind) is left alone."""
    try:
        lock = os.open(os.path.join(folder, OWNER_LOCK), os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    finally:
        os.close(lock)  # releases the lock if it was taken
    return True


def remove_folder(folder: str) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    lock = _held_locks.pop(folder, None)
    if lock is not None:
        os.close(lock)


def pull_socket(context: zmq.Context[Any], address: str) -> zmq.Socket[Any]:
    socket = context.socket(zmq.PULL)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVHWM, 0)  # the reader drains it every loop turn; never drop
    socket.bind(address)
    return socket


def push_socket(context: zmq.Context[Any], address: str, send_hwm: int) -> zmq.Socket[Any]:
    socket = context.socket(zmq.PUSH)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDHWM, send_hwm)  # past it, messages wait in the Sender (and merge)
    socket.connect(address)
    return socket


class Inbox:
    """Reads every message waiting on a PULL socket whenever its fd signals, and hands each,
    decoded, to `handle` (in arrival order). `turns` counts the reads: messages handled in one
    turn came together, and the tasks they woke have not run yet."""

    def __init__(self, socket: zmq.Socket[Any], decode: Callable[[bytes], Any],
                 handle: Callable[[Any], None]) -> None:
        self._socket = socket
        self._decode = decode
        self._handle = handle
        self._loop: asyncio.AbstractEventLoop | None = None
        self.turns = 0

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._socket.FD, self._drain)
        self._loop.call_soon(self._drain)  # messages that came before the reader was set

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._socket.FD)
        self._socket.close(linger=0)

    def _drain(self) -> None:
        socket, decode, handle = self._socket, self._decode, self._handle
        self.turns += 1
        while True:
            try:
                data = socket.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            except zmq.ZMQError:  # closed meanwhile
                return
            try:
                handle(decode(data.buffer))
            except Exception:  # one bad message must not stop the reader
                log.exception("a message could not be handled")


class Sender:
    """Sends on a PUSH socket without ever blocking: when the peer is behind (its high-water mark
    reached), messages queue here in order and go once the socket is writable; `on_drained`
    runs when the queue empties (so a caller can send what it held back meanwhile)."""

    def __init__(self, socket: zmq.Socket[Any], on_drained: Callable[[], None] | None = None) -> None:
        self._socket = socket
        self._queue: deque[bytes] = deque()
        self._on_drained = on_drained
        self._loop = asyncio.get_running_loop()
        self._watching = False
        self._timer: asyncio.TimerHandle | None = None

    @property
    def backlogged(self) -> bool:
        return bool(self._queue)

    def send(self, data: bytes) -> None:
        if self._queue:
            self._queue.append(data)
            return
        try:
            self._socket.send(data, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self._queue.append(data)
            self._watch()

    def close(self) -> None:
        self._unwatch()
        self._queue.clear()
        self._socket.close(linger=0)

    def _flush(self) -> None:
        while self._queue:
            try:
                self._socket.send(self._queue[0], zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self._arm_timer()
                return
            except zmq.ZMQError:  # closed
                self._queue.clear()
                break
            self._queue.popleft()
        self._unwatch()
        if self._on_drained is not None:
            self._on_drained()

    def _watch(self) -> None:
        if not self._watching:
            self._watching = True
            self._loop.add_reader(self._socket.FD, self._flush)
        self._arm_timer()

    def _arm_timer(self) -> None:
        if self._timer is None or self._timer.cancelled():
            self._timer = self._loop.call_later(RETRY_S, self._retry)

    def _retry(self) -> None:
        self._timer = None
        if self._queue:
            self._flush()

    def _unwatch(self) -> None:
        if self._watching:
            self._watching = False
            if not self._loop.is_closed():
                self._loop.remove_reader(self._socket.FD)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
