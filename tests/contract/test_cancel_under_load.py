"""A client that hangs up has its request's shard work stopped before the next step, also
when many streams share the batch: the router served by uvicorn (real Engine, fake shard
that records which requests every step carried)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import uvicorn
from api_fakes import WORDS, FakeShardClient

from loom_proto.config import RouterConfig
from loom_router.api import create_app
from loom_router.engine import Engine
from loom_router.tokenizer import load_tokenizer

NUM_STREAMS = 12
HANG_UP_AFTER = {0: 1, 3: 2, 5: 5, 8: 9, 11: 3}  # stream -> events read before hanging up


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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


@pytest.fixture
async def served() -> AsyncIterator[tuple[str, Engine, RecordingShard]]:
    tokenizer = load_tokenizer("")
    config = RouterConfig(model_id="", shard_uds_paths=("fake.sock",), hostname="127.0.0.1", port=free_port(),
                          max_total_tokens=256, max_n=2)
    backend = RecordingShard(tokenizer.encode(WORDS), tokenizer.vocab_size, eos_id=tokenizer.eos_token_ids[0],
                             max_n=config.max_n)
    backend.step_delay_s = 0.005
    engine = Engine(config, backend, tokenizer)
    server = uvicorn.Server(uvicorn.Config(create_app(engine, config, manage_engine=True), host=config.hostname,
                                           port=config.port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "the server did not start"
        await asyncio.sleep(0.01)
    yield f"http://127.0.0.1:{config.port}", engine, backend
    server.should_exit = True
    await asyncio.wait_for(task, 10)


async def test_hung_up_streams_leave_the_batch_before_the_next_step(
        served: tuple[str, Engine, RecordingShard]) -> None:
    url, engine, backend = served
    cancelled_at: dict[int, int] = {}  # group -> steps started when its cancel arrived
    real_cancel = engine.cancel

    def cancel(group_id: int) -> None:
        cancelled_at.setdefault(group_id, len(backend.step_groups))
        real_cancel(group_id)

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
