"""What the split into an engine core and frontends must not lose: a frontend that is gone has
its requests cancelled and their KV freed while the others' streams go on; a stop string found in
a frontend stops the core's computing at once; a client that stops reading delays no other
stream. The real engine core and frontend (tests/contract/router_harness.py) around a fake shard."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from api_fakes import WORDS, FakeShardClient
from router_harness import InProcessRouter, served_router, start_router, wait_for

from loom_proto.config import RouterConfig
from loom_proto.step import SamplingParams
from loom_router.tokenizer import Tokenizer, load_tokenizer
from loom_router.types import GenerationParams
from tests.net import free_port

SCRIPT = " alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu"


def config(**overrides: object) -> RouterConfig:
    base = dict(model_id="", shard_uds_paths=("fake.sock",), max_total_tokens=1024, max_n=2)
    return RouterConfig(**{**base, **overrides})


def long_params(max_new_tokens: int = 500) -> GenerationParams:
    return GenerationParams(choices=[SamplingParams(seed=1)], max_new_tokens=max_new_tokens, ignore_eos=True)


@pytest.fixture
async def router(tokenizer: Tokenizer) -> AsyncIterator[tuple[InProcessRouter, FakeShardClient]]:
    backend = FakeShardClient(tokenizer.encode(WORDS), tokenizer.vocab_size, eos_id=tokenizer.eos_token_ids[0],
                              num_blocks=1024, max_position_embeddings=1024)
    backend.step_delay_s = 0.002
    router = await start_router(config(), backend, tokenizer)
    try:
        yield router, backend
    finally:
        await router.stop()


async def test_a_gone_frontends_requests_are_cancelled_and_their_kv_freed_while_others_go_on(
        router: tuple[InProcessRouter, FakeShardClient], tokenizer: Tokenizer) -> None:
    r, _ = router
    other = await r.connect_frontend(1)
    prompt = tokenizer.encode("the quick brown fox")
    doomed = [await other.submit(prompt, long_params()) for _ in range(3)]
    survivor = await r.client.submit(prompt, long_params(60))
    await wait_for(lambda: r.engine.stats().num_running == 4)
    blocks_of_one = r.engine.stats().num_blocks_used // 4

    r.server.frontend_gone(1)  # what the frontend pool reports when that process exits

    await wait_for(lambda: r.engine.stats().num_running == 1)
    assert r.engine.stats().requests_finished.get("error") == 3  # counted as failed, not as finished
    assert r.engine.stats().num_blocks_used <= blocks_of_one + 1  # only the survivor holds blocks
    events = [event async for event in survivor]
    assert len(events) == 60 and events[-1].finish_reason is not None
    await wait_for(lambda: r.engine.stats().num_blocks_used == 0)
    assert not any(stream.closed for stream in doomed)  # their process is gone: nothing reaches them
    # No frontend is left to count them: the core does, in TGI's failures, summed with the frontends'
    exposition = (await r.http.get("/metrics")).text
    assert exposition.count("# TYPE tgi_request_failure counter") == 1
    assert 'tgi_request_failure{err="generation"} 3.0' in exposition


async def test_a_new_process_on_a_frontends_index_replaces_it_and_frees_what_the_old_one_had(
        router: tuple[InProcessRouter, FakeShardClient], tokenizer: Tokenizer,
        monkeypatch: pytest.MonkeyPatch) -> None:
    r, _ = router
    old = await r.connect_frontend(1)
    await old.submit(tokenizer.encode("the quick"), long_params())
    await wait_for(lambda: r.engine.stats().num_running == 1)
    monkeypatch.setattr("os.getpid", lambda: 999_999)  # the restarted frontend says Hello with its own pid
    new = await r.connect_frontend(1)
    await wait_for(lambda: r.engine.stats().num_running == 0 and r.engine.stats().num_blocks_used == 0)
    stream = await new.submit(tokenizer.encode("the quick"), long_params(5))
    assert len([event async for event in stream]) == 5  # the new process is served


async def test_a_stop_string_found_in_the_frontend_stops_the_core_within_a_step(
        router: tuple[InProcessRouter, FakeShardClient], tokenizer: Tokenizer) -> None:
    r, backend = router
    backend.script = tokenizer.encode(SCRIPT)
    backend.step_delay_s = 0.02  # steps slower than a message between the processes
    body = {"inputs": "x", "parameters": {"max_new_tokens": 200, "stop": [" delta"], "details": True}}
    out = (await r.http.post("/generate", json=body)).json()
    assert out["generated_text"] == " alpha beta gamma delta" and out["details"]["finish_reason"] == "stop_sequence"
    stop_at = len(tokenizer.encode(" alpha beta gamma delta"))
    await wait_for(lambda: r.engine.stats().num_running == 0)
    # The core heard of the stop before its next step (the one in flight may add one token).
    assert r.engine.stats().generated_tokens <= stop_at + 1, r.engine.stats()
    assert r.engine.stats().requests_finished.get("stop_sequence") == 1
    assert r.engine.stats().num_blocks_used == 0


async def test_a_client_that_stops_reading_delays_no_other_stream() -> None:
    """One client holds a stream it never reads (its socket's window full, the server's writes
    stalled); other streams run to their end at the pace of the steps meanwhile."""
    tokenizer = load_tokenizer("")
    cfg = config(hostname="127.0.0.1", port=free_port(), max_total_tokens=8192, max_top_n_tokens=5)
    backend = FakeShardClient(tokenizer.encode(WORDS), tokenizer.vocab_size, eos_id=tokenizer.eos_token_ids[0],
                              num_blocks=4096, max_position_embeddings=8192)
    async with served_router(cfg, backend, tokenizer) as (url, r, _):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", cfg.port))
        _, writer = await asyncio.open_connection(sock=sock)
        body = json.dumps({"inputs": "the quick", "parameters": {"max_new_tokens": 6000, "top_n_tokens": 5}})
        writer.write(b"POST /generate_stream HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body.encode())
        await writer.drain()
        await wait_for(lambda: r.engine.stats().generated_tokens > 1500)  # its writes have stalled by now
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            async def stream() -> tuple[int, float]:
                start, events = time.perf_counter(), 0
                async with client.stream("POST", "/generate_stream",
                                         json={"inputs": "the", "parameters": {"max_new_tokens": 40}}) as response:
                    async for line in response.aiter_lines():
                        events += line.startswith("data:")
                return events, time.perf_counter() - start

            results = await asyncio.gather(*(stream() for _ in range(4)))
        assert [events for events, _ in results] == [40] * 4
        assert r.engine.stats().num_running == 1  # the stalled one is still there, not cancelled
        assert max(seconds for _, seconds in results) < 10.0  # 40 steps of a fake shard: far less when nothing waits
        writer.close()
