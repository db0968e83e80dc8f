"""Slow clients against the router's real HTTP server (loom_router.main over real sockets, a fake
shard): headers or a body trickled a byte at a time, connections that say nothing, idle
keep-alive connections, and more connections than --max-connections. None may hold the server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from api_fakes import FakeShardClient
from test_api import router_config

from loom_router import main
from loom_router.tokenizer import Tokenizer
from tests.net import free_port

Serve = Callable[..., Any]


@pytest.fixture
async def serve(backend: FakeShardClient, tokenizer: Tokenizer,
                monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Serve]:
    """serve(**flags) -> the port of a router served by loom_router.main."""
    monkeypatch.setattr(main, "ShardClient", lambda targets, secret=None: backend)
    monkeypatch.setattr(main, "load_tokenizer", lambda model_id: tokenizer)
    servers: list[asyncio.Task[int]] = []

    async def start(**flags: Any) -> int:
        config = router_config(hostname="127.0.0.1", port=free_port(), **flags)
        servers.append(asyncio.create_task(main.serve(config)))
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{config.port}") as client:
            while True:
                assert not servers[-1].done(), "the router stopped before serving"
                try:
                    await client.get("/health")
                    return config.port
                except httpx.TransportError:
                    await asyncio.sleep(0.05)

    yield start
    for server in servers:
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)


async def trickle(port: int, at_once: bytes, slowly: bytes, interval_s: float = 0.2) -> tuple[float, bytes]:
    """Sends `at_once`, then `slowly` a byte at a time (never its last byte); returns when the
    server closed the connection: the seconds it took and what the server answered."""
    start = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    answer = asyncio.ensure_future(reader.read())  # everything until the server closes
    try:
        writer.write(at_once)
        for byte in slowly[:-1]:
            if answer.done():
                break
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(interval_s)
        return time.monotonic() - start, await asyncio.wait_for(answer, 30)
    except ConnectionError:
        return time.monotonic() - start, b""
    finally:
        writer.close()


HEAD = b"GET /health HTTP/1.1\r\nHost: loom\r\nX-Padding: " + b"x" * 200 + b"\r\n\r\n"
POST_HEAD = (b"POST /generate HTTP/1.1\r\nHost: loom\r\nContent-Type: application/json\r\n"
             b"Content-Length: 100\r\n\r\n")


async def test_headers_trickled_a_byte_at_a_time_are_cut_and_others_are_served(serve: Serve) -> None:
    port = await serve(header_timeout=1.0)
    loris = [asyncio.ensure_future(trickle(port, b"", HEAD)) for _ in range(30)]
    await asyncio.sleep(0.3)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
        assert (await client.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}})
                ).status_code == 200
    for took, answer in await asyncio.gather(*loris):
        assert took < 3.0, took
        assert answer.startswith(b"HTTP/1.1 408"), answer


async def test_a_connection_that_sends_nothing_is_closed(serve: Serve) -> None:
    port = await serve(header_timeout=1.0)
    start = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    assert time.monotonic() - start < 3.0 and answer.startswith(b"HTTP/1.1 408")


async def test_a_body_trickled_a_byte_at_a_time_is_cut(serve: Serve) -> None:
    port = await serve(body_timeout=1.0)
    body = b'{"inputs": "hi", "parameters": {"max_new_tokens": 2}}'.ljust(100)
    took, _ = await trickle(port, POST_HEAD, body)
    assert took < 3.0, took


async def test_an_idle_keep_alive_connection_is_closed(serve: Serve) -> None:
    port = await serve(keep_alive_timeout=1.0)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: loom\r\n\r\n")
    await writer.drain()
    start = time.monotonic()
    answer = await asyncio.wait_for(reader.read(), 10)  # the response, then the close
    writer.close()
    assert answer.startswith(b"HTTP/1.1 200") and time.monotonic() - start < 3.0


async def test_past_max_connections_a_request_gets_503_at_once(serve: Serve) -> None:
    port = await serve(max_connections=4, header_timeout=30.0)
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]  # idle, mid-request
    for _, writer in held:
        writer.write(b"GET /health HTTP/1.1\r\n")
        await writer.drain()
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
        start = time.monotonic()
        response = await client.get("/info")
        assert response.status_code == 503 and time.monotonic() - start < 1.0
        for _, writer in held:
            writer.close()
        await asyncio.sleep(0.2)
        assert (await client.get("/info")).status_code == 200
