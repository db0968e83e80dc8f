"""Step's fast lane: the same StepPlan and StepResult messages as the gRPC Step, framed on a plain
unix stream socket beside each shard's gRPC socket (`<uds_path>.step`).

Every step crosses router -> shard -> router, and a gRPC unary call through grpcio's asyncio
stack costs ~0.2 ms of CPU in the router and ~0.3 ms in the shard, ~0.5 ms of wall time for a
round trip that does nothing (bench/bench_step_channel.py; a frame here: ~0.05 ms): more than a
whole decode step is allowed to add at one stream. Everything else (Info, Health, Warmup,
Release, snapshots, and Step itself, for any client: a shard reached over TCP has no step
socket) stays on gRPC.

    request: u32 plan length | StepPlan bytes | u32 metadata length | metadata
             (metadata: `key=value` lines, UTF-8: the W3C trace context gRPC would carry)
    reply:   u8 status | u32 length | StepResult bytes (status 0), or the UTF-8 error message
             (status: a gRPC status code, e.g. 3 INVALID_ARGUMENT, 13 INTERNAL)

Requests on one connection are answered in order; a client may send the next before the
previous one's reply (the router's one step of lookahead). Little-endian lengths.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

SOCKET_SUFFIX = ".step"
OK = 0
_LENGTH = struct.Struct("<I")
_REPLY_HEAD = struct.Struct("<BI")

Metadata = tuple[tuple[str, str], ...]
# What a shard does with one request: the reply's status and payload.
StepHandler = Callable[[bytes, Metadata], Awaitable[tuple[int, bytes]]]


def socket_path(uds_path: str) -> str:
    """The step socket of the shard serving gRPC on `uds_path`."""
    return uds_path + SOCKET_SUFFIX


def encode_request(plan: bytes, metadata: Metadata | None) -> bytes:
    meta = "".join(f"{key}={value}\n" for key, value in metadata or ()).encode()
    return _LENGTH.pack(len(plan)) + plan + _LENGTH.pack(len(meta)) + meta


def encode_reply(status: int, payload: bytes) -> bytes:
    return _REPLY_HEAD.pack(status, len(payload)) + payload


def _metadata(raw: bytes) -> Metadata:
    pairs = (line.split("=", 1) for line in raw.decode().splitlines() if "=" in line)
    return tuple((key, value) for key, value in pairs)


class _Frames:
    """Bytes in, whole frames out (a frame may arrive in pieces, several in one read)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> None:
        self._buffer += data

    def request(self) -> tuple[bytes, Metadata] | None:
        buffer = self._buffer
        if len(buffer) < 4:
            return None
        (plan_length,) = _LENGTH.unpack_from(buffer, 0)
        meta_at = 4 + plan_length
        if len(buffer) < meta_at + 4:
            return None
        (meta_length,) = _LENGTH.unpack_from(buffer, meta_at)
        end = meta_at + 4 + meta_length
        if len(buffer) < end:
            return None
        plan, meta = bytes(buffer[4:meta_at]), bytes(buffer[meta_at + 4:end])
        del buffer[:end]
        return plan, _metadata(meta)

    def reply(self) -> tuple[int, bytes] | None:
        buffer = self._buffer
        if len(buffer) < _REPLY_HEAD.size:
            return None
        status, length = _REPLY_HEAD.unpack_from(buffer, 0)
        end = _REPLY_HEAD.size + length
        if len(buffer) < end:
            return None
        payload = bytes(buffer[_REPLY_HEAD.size:end])
        del buffer[:end]
        return status, payload


class ServerProtocol(asyncio.Protocol):
    """A shard's side of one connection: requests handled as they arrive (the handler queues them
    on the shard's step thread, in order), replies written in request order."""

    def __init__(self, handle: StepHandler) -> None:
        self._handle = handle
        self._frames = _Frames()
        self._pending: deque[asyncio.Future[tuple[int, bytes]]] = deque()
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: Any) -> None:
        self._transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None

    def data_received(self, data: bytes) -> None:
        self._frames.feed(data)
        while (request := self._frames.request()) is not None:
            reply = asyncio.ensure_future(self._handle(*request))
            self._pending.append(reply)
            reply.add_done_callback(self._write_ready)

    def _write_ready(self, _: object) -> None:
        while self._pending and self._pending[0].done():
            reply = self._pending.popleft()
            if self._transport is not None and not reply.cancelled():
                self._transport.write(encode_reply(*reply.result()))


def refuse_live_socket(path: str) -> None:
    """Raises OSError when a process still accepts connections on the unix socket at `path`
    (another server's, which binding there would take over); a stale file is left to replace."""
    if not os.path.exists(path):
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return  # nobody listens: stale
    raise OSError(f"another process serves on {path}: give this server another socket path")


async def serve(path: str, handle: StepHandler) -> asyncio.AbstractServer:
    """Serve the step socket at `path` (a stale file there is replaced)."""
    refuse_live_socket(path)
    if os.path.exists(path):
        os.unlink(path)
    return await asyncio.get_running_loop().create_unix_server(lambda: ServerProtocol(handle), path)


def close(server: asyncio.AbstractServer) -> None:
    """Stop serving and remove the socket's file (asyncio leaves it behind before Python 3.13)."""
    paths = [sock.getsockname() for sock in server.sockets]
    server.close()
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)


class ChannelClosed(ConnectionError):
    """The shard closed its step socket (it died, or stopped)."""


class ClientProtocol(asyncio.Protocol):
    """The router's side: each request's reply on a future, in order."""

    def __init__(self) -> None:
        self._frames = _Frames()
        self._waiting: deque[asyncio.Future[tuple[int, bytes]]] = deque()
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: Any) -> None:
        self._transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        while self._waiting:
            future = self._waiting.popleft()
            if not future.done():
                future.set_exception(ChannelClosed(f"the shard's step socket closed ({exc or 'EOF'})"))

    def data_received(self, data: bytes) -> None:
        self._frames.feed(data)
        while (reply := self._frames.reply()) is not None:
            future = self._waiting.popleft()
            if not future.done():
                future.set_result(reply)

    def request(self, plan: bytes, metadata: Metadata | None) -> asyncio.Future[tuple[int, bytes]]:
        future: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()
        if self._transport is None:
            future.set_exception(ChannelClosed("the shard's step socket is closed"))
            return future
        self._waiting.append(future)
        self._transport.write(encode_request(plan, metadata))
        return future

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


async def connect(path: str) -> ClientProtocol:
    """Raises OSError when nothing serves `path`."""
    _, protocol = await asyncio.get_running_loop().create_unix_connection(ClientProtocol, path)
    return protocol
