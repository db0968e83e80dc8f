"""One step of lookahead (--overlap-steps, loom_router.core.lookahead) against the fake shard.

Every test runs the same requests with lookahead off and on and wants the same events, and
checks the invariants of running ahead: steps really overlapped, a sequence that finished was
already in the next step (its extra token never reaches the client), its blocks stay
allocated until that step came back (the fake shard checks every live request's blocks each
step), and everything is free at the end.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
from api_fakes import WORDS, FakeShardClient
from fake_shard import FailAt
from router_harness import InProcessRouter, settled_used_blocks, start_router
from test_api import router_config

from loom_proto.step import SamplingParams, StepPlan, StepResult
from loom_router.core.engine import Engine
from loom_router.frontend.stream import GenerationStream
from loom_router.structured.spec import ConstraintSpec
from loom_router.tokenizer import Tokenizer
from loom_router.types import GenerationError, GenerationParams

Event = tuple[int, int, str, str | None]  # choice index, token id, text, finish reason


@dataclass(slots=True)
class Probe:
    """Wraps the fake shard's step: how many steps overlapped, and that no step ever ran a
    sequence whose blocks the router had already freed."""

    engine: Engine
    backend: FakeShardClient
    in_flight: int = 0
    max_in_flight: int = 0
    early_frees: list[str] = field(default_factory=list)
    sent_ahead: list[StepPlan] = field(default_factory=list)  # sent while another step ran
    running: list[StepPlan] = field(default_factory=list)  # steps the shard has not answered yet
    shard_worker: asyncio.Lock = field(default_factory=asyncio.Lock)

    def install(self) -> None:
        step = self.backend.step

        async def probed(plan: StepPlan) -> StepResult:
            if self.in_flight:
                self.sent_ahead.append(plan)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.running.append(plan)
            try:
                async with self.shard_worker:  # one step at a time, in arrival order, like the shard's
                    await asyncio.sleep(0.005)  # the forward: the router takes the previous outputs meanwhile
                    self._check_blocks(plan)
                    return await step(plan)
            finally:
                self.in_flight -= 1
                self.running.remove(plan)

        self.backend.step = probed  # type: ignore[method-assign]

    def watch_frees(self) -> None:
        """Freeing a sequence's blocks while a step that runs it is unanswered is too early."""
        assert self.engine.scheduler is not None
        blocks = self.engine.scheduler.block_manager
        free = blocks.free

        def checked(seq):  # noqa: ANN001, ANN202 (a Sequence)
            if any(r.request_id == seq.seq_id for plan in self.running for r in plan.running_requests):
                self.early_frees.append(f"sequence {seq.seq_id} freed while a step running it is unanswered")
            free(seq)

        blocks.free = checked  # type: ignore[method-assign]

    def _check_blocks(self, plan: StepPlan) -> None:
        assert self.engine.scheduler is not None
        blocks = self.engine.scheduler.block_manager.blocks
        for request in plan.running_requests:
            state = self.backend.shard.states.get(request.request_id)
            if state is None:
                continue
            table = state.block_table + request.new_block_ids
            freed = [b for b in table if blocks[b].ref_count == 0]
            if freed:
                self.early_frees.append(f"request {request.request_id} runs on freed blocks {freed}")


async def events(stream: GenerationStream) -> list[Event]:
    return [(e.index, e.token.token_id, e.text, e.finish_reason.value if e.finish_reason else None)
            async for e in stream]


def params(seed: int, max_new_tokens: int = 12, n: int = 1, **kw: object) -> GenerationParams:
    choices = [SamplingParams(seed=seed + i, do_sample=True) for i in range(n)]
    return GenerationParams(choices, max_new_tokens=max_new_tokens, **kw)  # type: ignore[arg-type]


async def start(tokenizer: Tokenizer, overlap: bool | None, num_blocks: int = 256, eos_at: int | None = None,
                device: str = "cpu", **config: object) -> tuple[InProcessRouter, FakeShardClient, Probe]:
    backend = FakeShardClient(tokenizer.encode(WORDS), tokenizer.vocab_size, eos_id=tokenizer.eos_token_ids[0],
                              num_blocks=num_blocks)
    backend.eos_at = eos_at
    backend.device = device
    router = await start_router(router_config(overlap_steps=overlap, max_concurrent_requests=16, **config), backend,
                                tokenizer, start=False)
    probe = Probe(router.engine, backend)
    probe.install()
    await router.start()
    probe.watch_frees()
    return router, backend, probe


async def run_both(tokenizer: Tokenizer, requests: list[tuple[str, GenerationParams]],
                   **kw: object) -> tuple[list[list[Event]], Probe]:
    """The same concurrent requests with lookahead off, then on; the on run's probe."""
    outputs: dict[bool, list[list[Event]]] = {}
    for overlap in (False, True):
        router, backend, probe = await start(tokenizer, overlap, **kw)  # type: ignore[arg-type]
        try:
            streams = await asyncio.gather(*(router.client.submit(tokenizer.encode(prompt), p) for prompt, p in requests))
            outputs[overlap] = list(await asyncio.gather(*(events(s) for s in streams)))
            await assert_all_free(router.engine)
        finally:
            await router.stop()
        assert probe.early_frees == []
    assert outputs[True] == outputs[False]
    return outputs[True], probe


async def assert_all_free(engine: Engine) -> None:
    assert engine.scheduler is not None
    assert await settled_used_blocks(engine) == 0
    assert engine._late == []


async def test_same_tokens_and_steps_really_overlap(tokenizer: Tokenizer) -> None:
    requests = [(f"prompt number {i}", params(i, max_new_tokens=10 + 3 * i)) for i in range(5)]
    outs, probe = await run_both(tokenizer, requests)
    assert probe.max_in_flight == 2  # a step was sent while its predecessor ran
    assert [len(out) for out in outs] == [10 + 3 * i for i in range(5)]  # length cuts: no extra token


async def test_eos_in_a_step_ahead_discards_the_extra_token(tokenizer: Tokenizer) -> None:
    requests = [(f"eos {i}", params(i, max_new_tokens=20)) for i in range(3)]
    outs, probe = await run_both(tokenizer, requests, eos_at=4)
    assert probe.max_in_flight == 2
    for out in outs:
        assert len(out) == 5 and out[-1][3] == "eos_token"


async def test_eos_finished_sequence_was_run_once_more_then_released(tokenizer: Tokenizer) -> None:
    router, backend, probe = await start(tokenizer, overlap=True, eos_at=4)
    engine, client = router.engine, router.client
    try:
        prompt = tokenizer.encode("one more step")
        out = await events(await client.submit(prompt, params(3, max_new_tokens=20)))
        assert len(out) == 5
        await assert_all_free(engine)
        await engine.run_between_steps(lambda s: None)  # after the step that sent the release
        seq_id = 0  # the first request's first sequence
        runs = [plan for plan in backend.shard.plans if any(r.request_id == seq_id for r in plan.running_requests)]
        releases = [i for i, plan in enumerate(backend.shard.plans) if seq_id in plan.released_ids]
        assert len(runs) == 5  # 4 decodes for tokens 2..5, and the one ahead whose token was dropped
        assert len(releases) == 1 and backend.shard.plans.index(runs[-1]) < releases[0]
        assert probe.early_frees == []
    finally:
        await router.stop()


async def test_stop_strings(tokenizer: Tokenizer) -> None:
    requests = [(f"stop {i}", params(i, max_new_tokens=30, stop_sequences=[stop]))
                for i, stop in enumerate([" fox", "lazy", " the sun", "never there"])]
    outs, _ = await run_both(tokenizer, requests)
    assert [out[-1][3] for out in outs][:2] == ["stop_sequence", "stop_sequence"]


async def test_n_forks_and_preemption(tokenizer: Tokenizer) -> None:
    requests = [(f"forks and pressure {i}", params(10 * i, max_new_tokens=24, n=1 + i % 3)) for i in range(6)]
    _, probe = await run_both(tokenizer, requests, num_blocks=40)  # too few blocks for all: preemption
    assert probe.max_in_flight == 2


async def test_grammar_requests_never_run_ahead(tokenizer: Tokenizer) -> None:
    router, backend, probe = await start(tokenizer, overlap=True)
    engine, client = router.engine, router.client
    try:
        constrained = params(5, max_new_tokens=16,
                             constraint=ConstraintSpec.choice(["yes please", "no thanks", "maybe later"]))
        free = await client.submit(tokenizer.encode("free"), params(6, max_new_tokens=40))
        out = await events(await client.submit(tokenizer.encode("answer"), constrained))
        assert "".join(e[2] for e in out) in {"yes please", "no thanks", "maybe later"}
        await events(free)
        constrained_id = 1 * engine.config.max_n  # the second group's only sequence
        assert probe.sent_ahead  # the free request ran ahead, alone, after the constrained one finished
        assert not any(r.request_id == constrained_id for plan in probe.sent_ahead for r in plan.running_requests)
        assert any(constrained_id in plan.allowed_token_masks for plan in backend.shard.plans)
        await assert_all_free(engine)
    finally:
        await router.stop()


async def test_abort_while_a_step_runs_ahead(tokenizer: Tokenizer) -> None:
    router, backend, probe = await start(tokenizer, overlap=True)
    engine, client = router.engine, router.client
    try:
        stream = await client.submit(tokenizer.encode("to be cancelled"), params(1, max_new_tokens=50))
        other = await client.submit(tokenizer.encode("keeps going"), params(2, max_new_tokens=30))
        got = 0
        async for _ in stream:
            got += 1
            if got == 5:
                stream.cancel()
                break
        out = await events(other)
        assert [e[1] for e in out] == backend.reference(tokenizer.encode("keeps going"), 2, 30) or len(out) == 30
        await assert_all_free(engine)
        assert probe.early_frees == [] and probe.max_in_flight == 2
        assert engine.stats().requests_finished.get("cancelled") == 1
    finally:
        await router.stop()


@pytest.mark.parametrize("fail_at", [FailAt.START, FailAt.AFTER_FORWARD])
async def test_failed_step_with_a_step_ahead_rolls_back(tokenizer: Tokenizer, fail_at: FailAt) -> None:
    router, backend, probe = await start(tokenizer, overlap=True)
    engine, client = router.engine, router.client
    try:
        prompt = tokenizer.encode("Hello there")
        reference = await events(await client.submit(prompt, params(1, max_new_tokens=8)))
        start_plans = len(backend.shard.plans)
        backend.shard.fail_at = fail_at
        backend.shard.fail_when = lambda plan: len(backend.shard.plans) == start_plans + 4  # mid-decode
        with pytest.raises(GenerationError, match="injected failure"):
            await events(await client.submit(prompt, params(1, max_new_tokens=8)))
        assert await events(await client.submit(prompt, params(1, max_new_tokens=8))) == reference
        await assert_all_free(engine)
        assert probe.early_frees == [] and probe.max_in_flight == 2
    finally:
        await router.stop()


@pytest.mark.parametrize("fail_at", [FailAt.START, FailAt.AFTER_FORWARD])
async def test_a_failed_prompt_step_rolls_back_the_step_sent_ahead_of_it(tokenizer: Tokenizer,
                                                                          fail_at: FailAt) -> None:
    """The step after a prompt's step decodes its first token (sent ahead): when the prompt's step
    fails, that step is rolled back too, the request fails alone, and the next one runs as before."""
    router, backend, probe = await start(tokenizer, overlap=True)
    engine, client = router.engine, router.client
    try:
        prompt = tokenizer.encode("Hello there")
        reference = await events(await client.submit(prompt, params(1, max_new_tokens=8)))
        backend.shard.fail_at = fail_at
        backend.shard.fail_when = lambda plan: bool(plan.new_requests)
        with pytest.raises(GenerationError, match="injected failure"):
            await events(await client.submit(prompt, params(1, max_new_tokens=8)))
        backend.shard.fail_when = lambda plan: False
        assert await events(await client.submit(prompt, params(1, max_new_tokens=8))) == reference
        await assert_all_free(engine)
        assert probe.early_frees == []
        failed_id = 1 * engine.config.max_n  # the second group's only sequence
        assert any(r.request_id == failed_id for plan in probe.sent_ahead for r in plan.running_requests), \
            "no step decoding the failed prompt's token was sent ahead of it"
    finally:
        await router.stop()


async def test_a_request_arriving_mid_decode_starts_in_the_step_sent_ahead(tokenizer: Tokenizer) -> None:
    """No drain for an arrival: its prompt runs in the next step sent ahead (it used to wait
    for the step in flight and the one queued behind it), with the same events as without."""
    outputs: dict[bool, tuple[list[Event], list[Event]]] = {}
    for overlap in (False, True):
        router, _, probe = await start(tokenizer, overlap)
        engine, client = router.engine, router.client
        try:
            first = await client.submit(tokenizer.encode("the first prompt"), params(1, max_new_tokens=30))
            seen: list[Event] = []
            second: asyncio.Future[list[Event]] | None = None
            async for e in first:
                seen.append((e.index, e.token.token_id, e.text, e.finish_reason.value if e.finish_reason else None))
                if len(seen) == 5:  # a steady decode by now: with lookahead, two steps are on the shard
                    later = await client.submit(tokenizer.encode("a later prompt"), params(7, max_new_tokens=12))
                    second = asyncio.ensure_future(events(later))
            assert second is not None
            outputs[overlap] = (seen, await second)
            await assert_all_free(engine)
        finally:
            await router.stop()
        assert probe.early_frees == []
        if overlap:
            assert any(plan.new_requests for plan in probe.sent_ahead), "the arrival waited for a drain"
    assert outputs[True] == outputs[False]


async def test_the_step_after_new_prompts_is_sent_ahead(tokenizer: Tokenizer) -> None:
    """A step that computes whole prompts samples their first tokens: the step decoding them is
    planned while it runs (no drain at each admission), with the same events as without lookahead.
    A prompt that goes on in another chunk waits for its step's outputs."""
    requests = [(f"a wave of prompts {i} " * (1 + 6 * (i == 3)), params(i, max_new_tokens=6)) for i in range(4)]
    _, probe = await run_both(tokenizer, requests, max_batch_prefill_tokens=40)
    plans = probe.backend.shard.plans
    news = [n for plan in plans for n in plan.new_requests]
    assert any(n.num_cached + n.num_compute < len(n.token_ids) for n in news)  # the long prompt: two chunks
    first_decodes = [next(plan for plan in plans if any(r.request_id == n.request_id for r in plan.running_requests))
                     for n in news if n.num_cached + n.num_compute == len(n.token_ids)]
    assert any(plan in probe.sent_ahead for plan in first_decodes), "every first decode waited for its prompt's step"
    assert probe.engine.stats().steps_planned_ahead == len(probe.sent_ahead)  # loom_steps_planned_ahead


@pytest.mark.parametrize(("device", "speculate", "expected"), [("cuda", 0, 2), ("cuda:1", 0, 2), ("cpu", 0, 1),
                                                             ("cuda", 3, 1)])
async def test_by_default_steps_overlap_where_the_shards_run_on_a_gpu(tokenizer: Tokenizer, device: str,
                                                                        speculate: int, expected: int) -> None:
    # Unset, --overlap-steps follows the shards' device: on CUDA the engine core plans the next
    # step while the GPU runs one; on CPU, or with drafts to verify, one step at a time.
    router, _, probe = await start(tokenizer, None, device=device, speculate=speculate)
    try:
        streams = [await router.client.submit(tokenizer.encode(f"default {i}"), params(i)) for i in range(3)]
        for stream in streams:
            assert len(await events(stream)) == 12
        assert router.engine.overlap_steps is (expected == 2)
        assert probe.max_in_flight == expected
    finally:
        await router.stop()


@pytest.mark.parametrize("overlap", [False, True])
async def test_an_explicit_overlap_steps_wins_over_the_device(tokenizer: Tokenizer, overlap: bool) -> None:
    router, _, _ = await start(tokenizer, overlap, device="cuda" if not overlap else "cpu")
    try:
        assert router.engine.overlap_steps is overlap
    finally:
        await router.stop()


@pytest.mark.parametrize(("device", "flags", "expected"), [("cpu", {}, 512), ("cuda:0", {}, 2048),
                                                          ("cuda", {"max_batch_prefill_tokens": 100}, 100),
                                                          ("cpu", {"max_batch_total_tokens": 300}, 300)])
async def test_the_prefill_budget_follows_the_shards_device(tokenizer: Tokenizer, device: str,
                                                           flags: dict[str, int], expected: int) -> None:
    # Unset, --max-batch-prefill-tokens is 2048 on CUDA and 512 on CPU (where a step of 2048 takes
    # seconds), never more than the KV cache; the shards warm up for it, the scheduler plans with
    # it and the frontends report it (/info).
    router, backend, _ = await start(tokenizer, None, device=device, **flags)
    try:
        assert router.engine.max_batch_prefill_tokens == expected
        assert backend.warmup_args is not None and backend.warmup_args[0] == expected
        assert router.engine.scheduler is not None and router.engine.scheduler.config.max_batch_prefill_tokens == expected
        assert router.engine.limits is not None and router.engine.limits.max_batch_prefill_tokens == expected
    finally:
        await router.stop()
