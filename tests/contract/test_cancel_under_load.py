"""A client that hangs up has its request's shard work stopped before the next step, also
when many streams share the batch, and a client that never reads is cancelled at its
stream's buffer bound: the router served by uvicorn (a frontend and an engine core, fake shard
that records which requests every step carried)."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from api_fakes import WORDS, FakeShardClient
from router_harness import served_router

from loom_proto.config import RouterConfig
from loom_router.core.engine import Engine
from loom_router.tokenizer import load_tokenizer
from tests.net import free_port

NUM_STREAMS = 12
HANG_UP_AFTER = {0: 1, 3: 2, 5: 5, 8: 9, 11: 3}  # stream -> events read before hanging up



class RecordingShard(FakeShardClient):
    """Records the groups each step carries, in the order the steps start."""

    def __init__(self, *args: Any, max_n: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_n = max_n
        self.step_groups: list[set[int]] = []

    async def step(self, plan: Any) -> Any:
        requests = (*plan.new_requests, *plan.running_requests)
        self.step_groups.append({r.request_id // self.max_n for r in requests})
        return await super().step(plan)


@asynccontextmanager
async def serving(config: RouterConfig, backend: FakeShardClient) -> AsyncIterator[tuple[str, Engine]]:
    async with served_router(config, backend, load_tokenizer("")) as (url, router, _):
        yield url, router.engine


@pytest.fixture
async def served() -> AsyncIterator[tuple[str, Engine, RecordingShard]]:
    tokenizer = load_tokenizer("")
    config = RouterConfig(model_id="", shard_uds_paths=("fake.sock",), hostname="127.0.0.1", port=free_port(),
                          max_total_tokens=256, max_n=2)
    backend = RecordingShard(tokenizer.encode(WORDS), tokenizer.vocab_size, eos_id=tokenizer.eos_token_ids[0],
                             max_n=config.max_n)
    backend.step_delay_s = 0.005
    async with serving(config, backend) as (url, engine):
        yield url, engine, backend


async def test_hung_up_streams_leave_the_batch_before_the_next_step(
        served: tuple[str, Engine, RecordingShard]) -> None:
    url, engine, backend = served
    cancelled_at: dict[int, int] = {}  # group -> steps started when its cancel arrived
    real_cancel = engine.cancel

    def cancel(group_id: int, outcome: str = "cancelled") -> None:
        cancelled_at.setdefault(group_id, len(backend.step_groups))
        real_cancel(group_id, outcome)

    engine.cancel = cancel  # type: ignore[method-assign]

    async def one_stream(client: httpx.AsyncClient, index: int) -> int:
        body = {"inputs": f"the quick {index}", "parameters": {"max_new_tokens": 30}}
        read = 0
        async with client.stream("POST", "/generate_stream", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    read += 1
                    if read == HANG_UP_AFTER.get(index):
                        break
        return read

    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=NUM_STREAMS)) as c:
        reads = await asyncio.gather(*(one_stream(c, i) for i in range(NUM_STREAMS)))
    for _ in range(500):
        if not engine.stats().num_running:
            break
        await asyncio.sleep(0.01)
    assert [reads[i] for i in HANG_UP_AFTER] == list(HANG_UP_AFTER.values())
    assert sum(read == 30 for read in reads) == NUM_STREAMS - len(HANG_UP_AFTER)
    assert len(cancelled_at) == len(HANG_UP_AFTER)  # a finished stream's close cancels nothing
    for group in cancelled_at:
        # the step in flight when the client left may carry it; no later step does
        later = backend.step_groups[cancelled_at[group] + 1:]
        assert all(group not in groups for groups in later), group
        assert cancelled_at[group] + 1 < len(backend.step_groups)  # the others kept stepping
    assert engine.stats().num_blocks_used == 0
    assert engine.stats().requests_finished["cancelled"] == len(HANG_UP_AFTER)


@pytest.mark.slow  # ~10 s: megabytes of events must fill the socket buffers first
async def test_a_client_that_never_reads_is_cancelled_and_holds_nothing() -> None:
    """A real socket left unread: the server's writes stall on TCP back-pressure, the
    stream's buffer fills, the request is cancelled and its blocks freed while the client
    still holds the connection; a second client is served meanwhile."""
    tokenizer = load_tokenizer("")
    config = RouterConfig(model_id="", shard_uds_paths=("fake.sock",), hostname="127.0.0.1", port=free_port(),
                          max_total_tokens=8192, stream_buffer_events=16, max_top_n_tokens=5)
    backend = FakeShardClient(tokenizer.encode(WORDS), tokenizer.vocab_size, eos_id=tokenizer.eos_token_ids[0],
                              num_blocks=4096, max_position_embeddings=8192)
    async with serving(config, backend) as (url, engine):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
        sock.connect(("127.0.0.1", config.port))
        _, writer = await asyncio.open_connection(sock=sock)
        body = json.dumps({"inputs": "the quick",  # ~500-byte events: MBs in all, more than the buffers
                           "parameters": {"max_new_tokens": 8000, "top_n_tokens": 5}}).encode()
        writer.write(b"POST /generate_stream HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        await writer.drain()
        for _ in range(3000):  # never read: wait for the cancellation
            if engine.stats().requests_finished.get("cancelled"):
                break
            await asyncio.sleep(0.01)
        assert engine.stats().requests_finished.get("cancelled") == 1, engine.stats()
        assert engine.stats().num_blocks_used == 0 and engine.stats().num_running == 0
        assert engine.stats().generated_tokens < 8000
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            response = await client.post("/generate", json={"inputs": "the", "parameters": {"max_new_tokens": 3}})
            assert response.status_code == 200
        writer.close()
