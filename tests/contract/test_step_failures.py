"""What a failed step does to the engine: its requests fail visibly, later ones are exact; ranks
of a tensor-parallel group that end a step differently are fatal (the engine stops, named)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import httpx
import pytest
from api_fakes import WORDS, FakeShardClient
from router_harness import start_router
from test_api import router_config

from loom_proto.step import StepPlan, StepResult
from loom_router import main
from loom_router.core.shard_client import ShardError, agreed_step_reply
from loom_router.frontend.validation import Limits, TGIParameters, tgi_generation_params
from loom_router.tokenizer import Tokenizer
from loom_router.types import GenerationError, GenerationParams, ShardDivergence
from tests.net import free_port


def params(seed: int, max_new_tokens: int = 4) -> GenerationParams:
    limits = Limits(max_stop_sequences=2, max_top_n_tokens=3, max_n=4, vocab_size=49152, eos_token_ids=(2,))
    return tgi_generation_params(TGIParameters(seed=seed, max_new_tokens=max_new_tokens), max_new_tokens, limits)


async def collect(stream) -> list[int]:  # noqa: ANN001
    return [event.token.token_id async for event in stream]


async def test_failed_step_fails_its_requests_and_later_ones_are_exact(tokenizer: Tokenizer) -> None:
    backend = FakeShardClient(tokenizer.encode(WORDS), tokenizer.vocab_size, eos_id=2)
    router = await start_router(router_config(), backend, tokenizer)
    engine, client = router.engine, router.client
    try:
        prompt = tokenizer.encode("Hello there")
        backend.shard.fail_when = lambda plan: len(backend.shard.plans) == 3  # mid-generation
        with pytest.raises(GenerationError, match="injected failure"):
            await collect(await client.submit(prompt, params(1)))
        assert engine.stats().requests_finished == {"error": 1}
        assert await collect(await client.submit(prompt, params(1))) == backend.reference(prompt, 1, 4)
        assert engine.scheduler is not None and engine.scheduler.block_manager.num_used_blocks == 0
    finally:
        await router.stop()


@pytest.mark.parametrize("n", [1, 2])
async def test_a_request_the_plan_cannot_encode_fails_alone(tokenizer: Tokenizer, n: int) -> None:
    """Validation bounds every field; should one slip through, its step still runs for the others."""
    backend = FakeShardClient(tokenizer.encode(WORDS), tokenizer.vocab_size, eos_id=2)
    backend.step_delay_s = 0.01
    router = await start_router(router_config(), backend, tokenizer)
    engine, client = router.engine, router.client
    try:
        prompt = tokenizer.encode("Hello there")
        good = asyncio.create_task(collect(await client.submit(prompt, params(1, max_new_tokens=8))))
        while engine.stats().num_running == 0:
            await asyncio.sleep(0.005)
        bad_params = params(2)
        bad_params.choices = [replace(bad_params.choices[0], seed=2 + i) for i in range(n)]
        bad_params.choices[-1].top_k = 2**32  # past the protocol's uint32 (n = 2: the fork's)
        with pytest.raises(GenerationError, match="cannot be sent to the shards"):
            await collect(await client.submit(prompt, bad_params))
        assert await good == backend.reference(prompt, 1, 8)
        assert engine.stats().requests_finished == {"error": 1, "length": 1}
        assert engine.scheduler is not None and engine.scheduler.block_manager.num_used_blocks == 0
        assert await collect(await client.submit(prompt, params(3))) == backend.reference(prompt, 3, 4)
    finally:
        await router.stop()


async def test_diverged_ranks_stop_the_engine_and_say_so(tokenizer: Tokenizer) -> None:
    backend = FakeShardClient(tokenizer.encode(WORDS), tokenizer.vocab_size, eos_id=2)

    async def diverging_step(plan: StepPlan) -> StepResult:
        raise ShardDivergence("tensor-parallel ranks diverged on a step (ranks [0] ran it; rank 1: boom)")

    backend.step = diverging_step  # type: ignore[method-assign]
    router = await start_router(router_config(), backend, tokenizer, start=False)
    engine, client = router.engine, router.client
    fatal: list[BaseException] = []
    engine.on_fatal = fatal.append
    await router.start()
    try:
        with pytest.raises(GenerationError, match="diverged"):
            await collect(await client.submit(tokenizer.encode("Hello"), params(1)))
        await asyncio.sleep(0)
        assert len(fatal) == 1 and isinstance(fatal[0], ShardDivergence)
        assert not await engine.health()
        with pytest.raises(GenerationError, match="not running"):
            await client.submit(tokenizer.encode("Hello"), params(1))  # the engine core refuses it
    finally:
        await router.stop()


def _futures(*outcomes: object) -> list[asyncio.Future]:
    loop = asyncio.get_running_loop()
    futures = []
    for outcome in outcomes:
        future = loop.create_future()
        if outcome == "cancelled":
            future.cancel()
        elif isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
        futures.append(future)
    return futures


async def test_rank_replies_agree_or_diverge() -> None:
    assert agreed_step_reply(_futures("r0", "r1")) == "r0"
    with pytest.raises(ShardError, match="rank 0"):  # every rank refused: an ordinary failed step
        agreed_step_reply(_futures(ShardError(0, "INVALID_ARGUMENT", "bad plan"),
                                   ShardError(1, "INVALID_ARGUMENT", "bad plan")))
    with pytest.raises(ShardDivergence, match=r"ranks \[0\] ran it; rank 1"):
        agreed_step_reply(_futures("r0", ShardError(1, "INTERNAL", "out of memory")))
    with pytest.raises(ShardDivergence, match="rank 1"):  # stuck in a collective after rank 0 failed
        agreed_step_reply(_futures(ShardError(0, "INTERNAL", "boom"), "cancelled"))


async def test_router_exits_non_zero_when_ranks_diverge(tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    backend = FakeShardClient(tokenizer.encode(WORDS), tokenizer.vocab_size, eos_id=2)

    async def diverging_step(plan: StepPlan) -> StepResult:
        raise ShardDivergence("tensor-parallel ranks diverged on a step (ranks [1] ran it; rank 0: boom)")

    backend.step = diverging_step  # type: ignore[method-assign]
    monkeypatch.setattr(main, "ShardClient", lambda targets, secret=None: backend)
    monkeypatch.setattr(main, "load_tokenizer", lambda model_id: tokenizer)
    config = router_config(hostname="127.0.0.1", port=free_port())
    serving = asyncio.create_task(main.serve(config))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{config.port}", timeout=30) as client:
        while True:
            assert not serving.done(), "the router stopped before serving"
            try:
                await client.get("/health")
                break
            except httpx.TransportError:
                await asyncio.sleep(0.05)
        response = await client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}})
    assert response.status_code == 424 and "diverged" in response.json()["error"]
    assert await asyncio.wait_for(serving, 30) == main.EXIT_ENGINE_FAILED
    assert "ranks diverged" in caplog.text


async def test_a_failed_steps_cause_reaches_the_client_without_paths_or_addresses(
        tokenizer: Tokenizer, caplog: pytest.LogCaptureFixture) -> None:
    backend = FakeShardClient(tokenizer.encode(WORDS), tokenizer.vocab_size, eos_id=2)
    router = await start_router(router_config(), backend, tokenizer)
    step = backend.step
    text = "RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer " \
           "[10.0.0.5]:29500"

    async def failing_step(plan):  # noqa: ANN001, ANN202
        if backend.num_steps == 2:
            raise ShardError(1, "INTERNAL", text)
        return await step(plan)

    backend.step = failing_step
    try:
        with pytest.raises(GenerationError) as error:
            await collect(await router.client.submit(tokenizer.encode("Hello there"), params(1)))
        assert str(error.value) == "Request failed during generation: shard rank 1: INTERNAL: RuntimeError: " \
                                   "Connection closed by peer"
        assert text in caplog.text  # the operator reads all of it
    finally:
        await router.stop()
