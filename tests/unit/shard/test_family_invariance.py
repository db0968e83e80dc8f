"""The serving properties Llama has, for the other families, in the default CPU dtype (bfloat16):
a sequence's tokens and logprobs are bit-identical alone or in a batch, however its prompt is
chunked, from the prefix cache, and after a preemption (swapped out and back in, or recomputed)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from loom_proto.config import ShardConfig
from loom_proto.step import NewRequest, RunningRequest, SamplingParams, StepPlan
from loom_shard.runtime.runner import ModelRunner
from tests.unit.shard.conftest import make_pair, random_tokens

BLOCK_SIZE = 4
NUM_NEW = 10
KINDS = ["gemma3", "gemma2", "qwen3_moe", "gpt_oss", "phi3", "mixtral"]


@dataclass(slots=True)
class Seq:
    request_id: int
    tokens: list[int]
    table: list[int]
    num_prompt: int = 0
    num_computed: int = 0
    on_shard: bool = False
    out: list[tuple[int, float]] = field(default_factory=list)  # (token, logprob)


class Driver:
    """A minimal scheduler: prefill chunks of `chunk` tokens, then decodes, all sequences together."""

    def __init__(self, runner: ModelRunner, chunk: int) -> None:
        self.runner, self.chunk = runner, chunk

    def step(self, seqs: list[Seq], **plan_fields: list) -> None:
        plan = StepPlan(**plan_fields)
        computing = []
        for s in seqs:
            n = min(self.chunk, len(s.tokens) - s.num_computed)
            if s.on_shard:
                plan.running_requests.append(RunningRequest(s.request_id, n))
            else:
                plan.new_requests.append(NewRequest(s.request_id, list(s.tokens), s.num_prompt, s.num_computed, n,
                                                    list(s.table), SamplingParams(seed=0)))
                s.on_shard = True
            computing.append((s, n))
        outputs = {o.request_id: o for o in self.runner.step(plan).outputs}
        for s, n in computing:
            s.num_computed += n
            out = outputs[s.request_id]
            if out.token_id is not None:
                s.tokens.append(out.token_id)
                s.out.append((out.token_id, out.logprob))

    def run(self, seqs: list[Seq], num_new: int = NUM_NEW) -> None:
        while any(len(s.out) < num_new for s in seqs):
            self.step([s for s in seqs if len(s.out) < num_new])


def _runner(kind: str, num_blocks: int = 600) -> ModelRunner:
    runner = ModelRunner(ShardConfig(model_id="tiny", uds_path="", dtype="bfloat16", block_size=BLOCK_SIZE),
                         model=make_pair(kind).loom)
    runner.allocate_kv_cache(num_blocks=num_blocks, num_host_blocks=128)
    return runner


def _seq(request_id: int, prompt: list[int], first_block: int, groups: int) -> Seq:
    """A sequence with blocks from first_block on: one per KV group (gemma's sliding layers keep
    theirs apart) for each logical block."""
    blocks = -(-(len(prompt) + NUM_NEW) // BLOCK_SIZE) * groups
    return Seq(request_id, list(prompt), list(range(first_block, first_block + blocks)), num_prompt=len(prompt))


PROMPT = random_tokens(37, 31)  # longer than the windows (8)


@pytest.mark.parametrize("kind", KINDS)
def test_alone_batched_and_chunked_are_bit_identical(kind: str) -> None:
    runner = _runner(kind)
    k = runner.kv_groups.num_groups
    alone = _seq(1, PROMPT, 0, k)
    Driver(runner, chunk=64).run([alone])
    # The same prompt in chunks of 5 beside three others (prefills and decodes mixed).
    watched = _seq(1, PROMPT, 40 * k, k)
    others = [_seq(2, random_tokens(23, 32), 0, k), _seq(3, random_tokens(9, 33), 14 * k, k),
              _seq(4, random_tokens(50, 34), 60 * k, k)]
    Driver(_runner(kind), chunk=5).run([others[0], watched, *others[1:]])
    assert watched.out == alone.out


@pytest.mark.parametrize("kind", KINDS)
def test_prefix_cache_and_preemption_give_the_same_tokens(kind: str) -> None:
    runner = _runner(kind)
    k = runner.kv_groups.num_groups
    reference = _seq(1, PROMPT, 0, k)
    Driver(runner, chunk=64).run([reference])
    runner = _runner(kind)
    driver = Driver(runner, chunk=64)
    # A first request fills 9 logical blocks with the prompt's first 36 tokens...
    driver.run([_seq(9, PROMPT[:36] + random_tokens(5, 35), 0, k)], num_new=1)
    # ...which the watched request then reuses as cached (prefix caching: 9 full blocks).
    watched = _seq(1, PROMPT, 50 * k, k)
    watched.table[: 9 * k] = range(9 * k)
    watched.num_computed = 36
    driver.step([watched], released_ids=[9])
    for _ in range(3):
        driver.step([watched])
    # Preempted by swapping: blocks to the host pool and back into other blocks.
    swap_out = [(b, h) for h, b in enumerate(watched.table)]
    driver.step([], released_ids=[1], swap_out=swap_out)
    watched.table = [70 * k + i for i in range(len(watched.table))]
    watched.on_shard = False
    driver.step([watched], swap_in=[(h, watched.table[h]) for _, h in swap_out])
    for _ in range(2):
        driver.step([watched])
    # Preempted by dropping its KV: recomputed from its tokens in other blocks.
    driver.step([], released_ids=[1])
    watched.table = [30 * k + i for i in range(len(watched.table))]
    watched.num_computed, watched.on_shard = 0, False
    driver.chunk = 7
    driver.run([watched])
    assert watched.out == reference.out


@pytest.mark.parametrize("kind", ["gemma3", "gpt_oss", "mistral"])
def test_blocks_out_of_every_window_are_never_read(kind: str) -> None:
    """What lets the router give a sliding group's old blocks to other sequences: poisoning them
    (NaN) once they fall out of the window changes nothing."""
    runner = _runner(kind)
    groups = runner.kv_groups
    reference = _seq(1, PROMPT, 0, groups.num_groups)
    Driver(runner, chunk=64).run([reference])
    runner = _runner(kind)
    driver = Driver(runner, chunk=9)
    watched = _seq(1, PROMPT, 0, groups.num_groups)
    poisoned = 0
    while len(watched.out) < NUM_NEW:
        driver.step([watched])
        for g, window in enumerate(groups.windows):
            if window is None:
                continue
            first_needed = max(0, watched.num_computed - window + 1) // BLOCK_SIZE  # the next query's first key
            for block in groups.table(watched.table, g)[:first_needed]:
                runner.kv_cache.device_blocks[:, :, block] = float("nan")
                poisoned += 1
    assert poisoned and watched.out == reference.out
