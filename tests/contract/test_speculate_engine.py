"""--speculate through the real engine and HTTP app against the fake shard: every request's
events (tokens, text, logprobs, finish reasons) are those of plain decoding, drafts were
really accepted, and all blocks are free at the end."""

from __future__ import annotations

import asyncio

from api_fakes import WORDS, FakeShardClient
from router_harness import settled_used_blocks, start_router
from test_api import router_config
from test_overlap import params

from loom_proto.step import SamplingParams
from loom_router.core.engine import Engine
from loom_router.frontend.stream import GenerationStream
from loom_router.structured.spec import ConstraintSpec
from loom_router.tokenizer import Tokenizer
from loom_router.types import GenerationParams

Event = tuple[int, int, str, str | None, float, list, int]  # index, token, text, reason, logprob, top, count


async def events(stream: GenerationStream) -> list[Event]:
    return [(e.index, e.token.token_id, e.text, e.finish_reason.value if e.finish_reason else None,
             e.token.logprob, e.token.top_tokens, e.num_generated) async for e in stream]


def cyclic_backend(tokenizer: Tokenizer, num_blocks: int = 256, eos_at: int | None = None) -> FakeShardClient:
    """A fake model that mostly continues a cycle of words (drafts found by lookup are right) and
    sometimes, depending on its context, does not (drafts get rejected)."""
    backend = FakeShardClient(tokenizer.encode(WORDS), tokenizer.vocab_size, eos_id=tokenizer.eos_token_ids[0],
                              num_blocks=num_blocks)
    backend.eos_at = eos_at
    words, plain_remap = backend.words, backend._remap

    def remap(request_id: int, index: int, token_id: int) -> int:
        if index == backend.eos_at or token_id % 4 == 0:
            return plain_remap(request_id, index, token_id)
        return words[index % 6]

    backend.shard.remap = remap
    return backend


def by_choice(out: list[Event]) -> list[list[Event]]:
    """A request's events per choice: a verify step streams a choice's tokens together, so the
    interleaving of n choices may differ from plain decoding's, never a choice's own events."""
    choices: dict[int, list[Event]] = {}
    for event in out:
        choices.setdefault(event[0], []).append(event)
    return [choices[i] for i in sorted(choices)]


async def run(tokenizer: Tokenizer, requests: list[tuple[str, GenerationParams]], speculate: int,
              **kw: object) -> tuple[list[list[Event]], Engine, FakeShardClient]:
    backend = cyclic_backend(tokenizer, **kw)  # type: ignore[arg-type]
    router = await start_router(router_config(speculate=speculate, max_concurrent_requests=16), backend, tokenizer)
    engine = router.engine
    try:
        streams = await asyncio.gather(*(router.client.submit(tokenizer.encode(prompt), p) for prompt, p in requests))
        outs = list(await asyncio.gather(*(events(s) for s in streams)))
        assert await settled_used_blocks(engine) == 0
    finally:
        await router.stop()
    return outs, engine, backend


async def same_as_plain(tokenizer: Tokenizer, requests: list[tuple[str, GenerationParams]],
                        **kw: object) -> tuple[list[list[Event]], Engine, FakeShardClient, int]:
    plain, _, plain_backend = await run(tokenizer, requests, 0, **kw)
    outs, engine, backend = await run(tokenizer, requests, 4, **kw)
    assert [by_choice(out) for out in outs] == [by_choice(out) for out in plain]
    stats = engine.stats()
    assert stats.spec_accepted_tokens > 0 and stats.spec_draft_tokens > stats.spec_accepted_tokens
    return outs, engine, backend, plain_backend.num_steps


async def test_same_events_greedy_and_seeded(tokenizer: Tokenizer) -> None:
    requests = [(f"prompt number {i}", params(i, max_new_tokens=20 + 3 * i)) for i in range(4)]
    greedy = SamplingParams(seed=0, top_n_tokens=2, repetition_penalty=1.1)
    requests.append(("greedy one", GenerationParams([greedy], max_new_tokens=25)))
    outs, _, backend, plain_steps = await same_as_plain(tokenizer, requests)
    assert [len(out) for out in outs] == [20, 23, 26, 29, 25]  # max_new_tokens inside accepted runs
    assert backend.num_steps < plain_steps


async def test_stop_sequences_and_eos_inside_an_accepted_run(tokenizer: Tokenizer) -> None:
    requests = [(f"stop {i}", params(i, max_new_tokens=40, stop_sequences=[stop]))
                for i, stop in enumerate([" fox jumps", " brown", " over the", "never there"])]
    outs, _, _, _ = await same_as_plain(tokenizer, requests, eos_at=17)
    assert [out[-1][3] for out in outs] == ["stop_sequence", "stop_sequence", "stop_sequence", "eos_token"]
    assert all(len(out) <= 18 for out in outs)


async def test_n_choices_and_preemption(tokenizer: Tokenizer) -> None:
    requests = [(f"forks and pressure {i}", params(10 * i, max_new_tokens=24, n=1 + i % 3,
                                                   stop_sequences=[" brown fox"] if i % 2 else []))
                for i in range(6)]
    # 26 blocks of 4 tokens hold one 3-choice request (3 x 30 tokens) and little else: however the
    # six arrive (a loaded machine admits them over several steps), their growth must preempt.
    _, engine, _, _ = await same_as_plain(tokenizer, requests, num_blocks=26)
    stats = engine.stats()
    assert stats.preemptions_swap + stats.preemptions_recompute > 0


async def test_constrained_requests_are_never_drafted(tokenizer: Tokenizer) -> None:
    backend = cyclic_backend(tokenizer)
    router = await start_router(router_config(speculate=4, max_concurrent_requests=16), backend, tokenizer)
    engine, client = router.engine, router.client
    try:
        constraint = ConstraintSpec.choice(["yes please yes please", "no thanks no thanks"])
        free = await client.submit(tokenizer.encode("free"), params(6, max_new_tokens=40))
        out = await events(await client.submit(tokenizer.encode("answer"),
                                               params(5, max_new_tokens=16, constraint=constraint)))
        assert "".join(e[2] for e in out) in {"yes please yes please", "no thanks no thanks"}
        await events(free)
        drafted = {r.request_id for plan in backend.shard.plans for r in plan.running_requests if r.draft_token_ids}
        assert 0 in drafted and 1 * engine.config.max_n not in drafted  # the free one drafted, never the other
    finally:
        await router.stop()


async def test_overlap_steps_turns_speculation_off(tokenizer: Tokenizer) -> None:
    backend = cyclic_backend(tokenizer)
    router = await start_router(router_config(speculate=4, overlap_steps=True), backend, tokenizer)
    engine = router.engine
    try:
        await events(await router.client.submit(tokenizer.encode("ahead"), params(1, max_new_tokens=20)))
        assert engine.scheduler is not None and engine.scheduler.speculator is None
        assert not any(r.draft_token_ids for plan in backend.shard.plans for r in plan.running_requests)
    finally:
        await router.stop()


async def test_streams_usage_and_metrics_count_every_accepted_token(tokenizer: Tokenizer) -> None:
    backend = cyclic_backend(tokenizer)
    router = await start_router(router_config(speculate=4), backend, tokenizer)
    try:
        async with router.http as client:
            body = {"model": "default", "prompt": "the quick", "max_tokens": 30, "stream": True, "seed": 3,
                    "stream_options": {"include_usage": True}}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                lines = [line async for line in response.aiter_lines() if line.startswith("data: {")]
            tgi = await client.post("/generate_stream", json={"inputs": "the quick", "parameters": {
                "max_new_tokens": 30, "do_sample": True, "seed": 3}})
            metrics = (await client.get("/metrics")).text
        assert '"completion_tokens":30' in lines[-1].replace(" ", "")
        assert sum(1 for line in tgi.text.splitlines() if line.startswith("data:")) == 30
        accepted = [line for line in metrics.splitlines() if line.startswith("loom_spec_accepted_tokens_total")]
        assert accepted and float(accepted[0].split()[-1]) > 0
    finally:
        await router.stop()


async def test_a_choice_stopping_inside_an_accepted_run_while_its_siblings_go_on(tokenizer: Tokenizer,
                                                                                  monkeypatch) -> None:
    """Drafts from the prompt run through a stop sequence: the tokens after it are never sent,
    while the request's other choices keep streaming."""
    after_stop = []  # (group, choice) whose tokens past the stop reached the frontend, to be dropped
    feed = GenerationStream.feed

    def watched(self, output, now):  # noqa: ANN001, ANN202
        before = len(self._events)
        feed(self, output, now)
        if before + len(output.token_ids) > len(self._events) and not self.overflowed:
            after_stop.append((output.group_id, output.index))

    monkeypatch.setattr(GenerationStream, "feed", watched)
    prompt = " the quick brown fox jumps over the quick brown fox jumps over"
    requests = [(prompt, params(i, max_new_tokens=30, n=3, stop_sequences=[" fox jumps over"])) for i in range(3)]
    outs, _, _, _ = await same_as_plain(tokenizer, requests)
    assert after_stop  # a verify step kept tokens past a stop (or the core ran on until told): dropped
    assert any(len({e[3] for e in choice}) > 1 for out in outs for choice in by_choice(out))
