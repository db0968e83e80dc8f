"""A step launched before the one ahead of it finished (ModelRunner.launch / finish): its decodes
read the tokens still on the device, and every output is what steps one at a time give. A step
that needs such a token's value finishes the ones before it first; forks and drafts are read
back at launch. On the CPU the device work is done by the time launch returns, so what these
tests check is the bookkeeping: the pending tokens, their patching into the inputs (eager and
through the step graphs' static inputs) and the order of finishing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from functools import partial

import pytest
import torch

from loom_proto.step import Fork, NewRequest, RunningRequest, SamplingParams, SeqOutput, StepPlan
from loom_shard.runtime.cuda_graphs import GraphSpec
from loom_shard.runtime.kv_cache import PagedKVCache
from loom_shard.runtime.requests import PENDING
from loom_shard.runtime.runner import ModelRunner
from loom_shard.server import ShardServicer
from tests.unit.shard.conftest import random_tokens, tiny_runner
from tests.unit.shard.test_step_graphs import EagerStepGraphs

BLOCK_SIZE = 4
NUM_BLOCKS = 96
BLOCKS_EACH = 8  # 32 tokens a request: prompt and every decode of these tests
PARAMS = {
    "greedy with alternatives": SamplingParams(seed=0, top_n_tokens=2),
    "seeded draw": SamplingParams(seed=5, do_sample=True, temperature=0.8, top_k=20),
    "bias and min tokens": SamplingParams(seed=1, logit_bias={3: 2.0}, min_new_tokens=4, eos_token_ids=[7]),
}
PENALTY = SamplingParams(seed=2, repetition_penalty=1.3)


def _new(request_id: int, prompt: list[int], sampling: SamplingParams, forks: list[Fork] | None = None) -> NewRequest:
    blocks = list(range(request_id * BLOCKS_EACH, (request_id + 1) * BLOCKS_EACH))
    return NewRequest(request_id, prompt, len(prompt), 0, len(prompt), blocks, sampling=sampling, forks=forks or [])


def _decodes(request_ids: list[int]) -> StepPlan:
    return StepPlan(running_requests=[RunningRequest(r, 1) for r in request_ids])


def decode_plans(samplings: list[SamplingParams], num_decodes: int) -> list[StepPlan]:
    """Prompts of 6-9 tokens, then num_decodes decode steps of every request."""
    first = StepPlan(new_requests=[_new(i, random_tokens(6 + i, 40 + i), s) for i, s in enumerate(samplings)])
    return [first] + [_decodes(list(range(len(samplings)))) for _ in range(num_decodes)]


def _key(outputs: list[SeqOutput]) -> list[tuple]:
    return [(o.request_id, o.token_id, o.logprob, [(t.token_id, t.logprob) for t in o.top_tokens]) for o in outputs]


def one_at_a_time(runner: ModelRunner, plans: list[StepPlan]) -> list[list[tuple]]:
    return [_key(runner.step(plan).outputs) for plan in plans]


def launched_ahead(runner: ModelRunner, plans: list[StepPlan],
                    while_two: Callable[[ModelRunner], None] = lambda runner: None) -> list[list[tuple]]:
    """Each plan launched before the one before it finishes; `while_two` looks at the runner
    while two steps are launched and unfinished."""
    results, previous = [], runner.launch(plans[0])
    for plan in plans[1:]:
        launched = runner.launch(plan)
        while_two(runner)
        results.append(_key(runner.finish(previous).outputs))
        previous = launched
    return results + [_key(runner.finish(previous).outputs)]


@pytest.fixture()
def runners(llama_pair) -> tuple[ModelRunner, ModelRunner]:
    return (tiny_runner(llama_pair, BLOCK_SIZE, NUM_BLOCKS), tiny_runner(llama_pair, BLOCK_SIZE, NUM_BLOCKS))


def test_decodes_launched_ahead_read_the_tokens_on_the_device(runners) -> None:
    plans = decode_plans(list(PARAMS.values()), num_decodes=10)
    seen: list[int] = []

    def two_unfinished(runner: ModelRunner) -> None:  # the step ahead was launched over pending tokens
        pending = [r for r in runner.requests.values() if PENDING in r.token_ids]
        assert pending and all(r.pending is not None for r in pending)
        seen.append(len(pending))

    expected = one_at_a_time(runners[0], plans)
    assert launched_ahead(runners[1], plans, two_unfinished) == expected
    assert seen == [len(PARAMS)] * 10
    assert all(PENDING not in r.token_ids and r.pending is None for r in runners[1].requests.values())


def test_a_penalty_over_a_pending_token_finishes_the_step_before(runners) -> None:
    plans = decode_plans([PARAMS["greedy with alternatives"], PENALTY], num_decodes=6)
    runner = runners[1]
    first = runner.launch(plans[0])
    second = runner.launch(plans[1])  # request 1's penalty reads the token the first step sampled
    assert first.result is not None and PENDING not in runner.requests[1].token_ids[:-1]
    runner.finish(second)
    expected = one_at_a_time(runners[0], plans)
    assert [_key(first.result.outputs), _key(second.result.outputs)] == expected[:2]
    assert launched_ahead(runner, plans[2:]) == expected[2:]


def test_forks_and_drafts_are_read_back_at_launch(runners) -> None:
    prompt = random_tokens(6, 50)
    forks = [Fork(9, SamplingParams(seed=3, do_sample=True), list(range(9 * BLOCKS_EACH, 10 * BLOCKS_EACH)))]
    plans = [StepPlan(new_requests=[_new(0, prompt, PARAMS["greedy with alternatives"], forks)]), _decodes([0, 9])]
    expected = one_at_a_time(runners[0], plans)
    runner = runners[1]
    launched = runner.launch(plans[0])
    assert launched.table is None  # read back: the fork copied its parent's tokens
    assert all(PENDING not in r.token_ids for r in runner.requests.values())
    assert _key(runner.finish(launched).outputs) == expected[0]
    token = expected[0][0][1]
    verify = StepPlan(running_requests=[RunningRequest(0, 3, draft_token_ids=[token, 5])])
    step_two = runner.launch(plans[1])
    drafts = runner.launch(verify)  # drafts ride on the pending token: the step before finishes first
    assert step_two.result is not None and drafts.table is None
    assert _key(step_two.result.outputs) == expected[1]
    reference = runners[0].step(verify).outputs[0]
    got = runner.finish(drafts).outputs[0]
    assert (got.token_id, got.draft_samples) == (reference.token_id, reference.draft_samples)


def test_anything_that_reads_the_cache_finishes_the_launched_steps(runners) -> None:
    runner = runners[1]
    plans = decode_plans([PARAMS["greedy with alternatives"]], num_decodes=1)
    first = runner.launch(plans[0])
    runner.read_kv(runner.requests[0].block_table[:2], 6)
    assert first.result is not None
    second = runner.launch(plans[1])
    runner.clear()
    assert second.result is not None and not runner.requests


@pytest.mark.parametrize("through", ["eager", "step graphs"])
def test_a_batch_of_decodes_and_a_prompt_launched_ahead(runners, llama_pair, through: str) -> None:
    """Decodes over pending tokens beside a new prompt and a decode whose token is known, each
    step's inputs patched on the device after they were staged (the graphs' static ids too)."""
    if through == "step graphs":
        for runner in runners:
            _cpu_step_graphs(runner)
    samplings = list(PARAMS.values())
    plans = decode_plans(samplings, num_decodes=3)
    late = _new(7, random_tokens(9, 60), PARAMS["greedy with alternatives"])
    plans[2] = StepPlan(running_requests=plans[2].running_requests, new_requests=[late])
    plans += [_decodes([0, 1, 2, 7]), _decodes([2, 7, 0]), _decodes([7])]
    assert launched_ahead(runners[1], plans) == one_at_a_time(runners[0], plans)
    if through == "step graphs":  # every step but the first (21 prompt tokens) fits a graph
        assert [r.step_graphs.num_replays for r in runners] == [len(plans) - 1] * 2


def _cpu_step_graphs(runner: ModelRunner) -> None:
    """The runner's steps through step graphs whose replay is an eager forward over the static
    inputs (the CUDA capture itself: tests/gpu)."""
    spec = runner.kv_spec
    runner.kv_cache = PagedKVCache(spec, NUM_BLOCKS, 0, "cpu", num_scratch_blocks=1)
    max_blocks = runner.model.config.max_position_embeddings // BLOCK_SIZE
    graphs = EagerStepGraphs(runner.model, runner.kv_cache.device_blocks, runner.attention.kernel,
                             GraphSpec(BLOCK_SIZE, max_blocks, max_blocks * BLOCK_SIZE - 1, NUM_BLOCKS, (1, 4, 8, 16)))
    with torch.inference_mode():
        graphs.capture()
    runner.step_graphs = graphs


def test_the_server_launches_a_step_that_arrives_before_the_last_finished(runners) -> None:
    """ShardServicer with launch_ahead: the step sent ahead (as the router's --overlap-steps sends
    it) launches before the one in flight finishes; the outputs are the same."""
    plans = decode_plans(list(PARAMS.values()), num_decodes=6)
    expected = one_at_a_time(runners[0], plans)
    runner = runners[1]
    launches: list[int] = []
    launch = runner.launch

    def counting_launch(plan: StepPlan, phases=None):  # noqa: ANN001, ANN202
        launches.append(len(runner._unfinished))  # steps launched and not finished before this one
        return launch(plan, phases)

    runner.launch = counting_launch  # type: ignore[method-assign]
    servicer = ShardServicer(runner, launch_ahead=True)
    try:
        got = asyncio.run(_two_in_flight(servicer, plans))
    finally:
        servicer.close()
    assert got == expected
    assert max(launches) == 1  # some step launched while the one before was unfinished


async def _two_in_flight(servicer: ShardServicer, plans: list[StepPlan]) -> list[list[tuple]]:
    """Each step sent as soon as the one two before it returned (one in flight, one ahead)."""
    step = partial(servicer.run_step, metadata=())
    tasks = [asyncio.ensure_future(step(plans[0]))]
    results = []
    for plan in plans[1:]:
        tasks.append(asyncio.ensure_future(step(plan)))
        results.append(_key((await tasks[-2]).outputs))
    return results + [_key((await tasks[-1]).outputs)]


def test_steps_launched_ahead_do_not_count_their_time_twice(runners) -> None:
    """A step's times count from the later of its launch and the end of the step before it, so
    that a shard's step times add up to no more than its wall time, however far ahead it launches."""
    runner, _ = runners
    plans = decode_plans(list(PARAMS.values()), num_decodes=6)
    begin = time.perf_counter()
    launched = [runner.launch(plan) for plan in plans]
    results = [runner.finish(step) for step in launched]
    wall_ms = (time.perf_counter() - begin) * 1e3
    assert sum(r.total_ms for r in results) <= wall_ms
    assert all(0 <= r.forward_ms <= r.total_ms for r in results)
