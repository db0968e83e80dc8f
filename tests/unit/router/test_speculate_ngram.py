"""Prompt-lookup drafts (loom_router.core.speculate) and the accept rule, with the scheduler and the
fake shard: outputs identical to plain decoding, blocks consistent on both sides."""

from __future__ import annotations

import random

import pytest
from fake_shard import Driver, FakeShard

from loom_proto.step import SamplingParams, accepted_drafts, blocks_after_verify
from loom_router.core.request import SequenceGroup
from loom_router.core.scheduler import Scheduler, SchedulerConfig
from loom_router.core.speculate import NgramIndex, SpeculateConfig, Speculator


def _seq(tokens: list[int], num_prompt: int | None = None):  # noqa: ANN202 (a Sequence)
    num_prompt = len(tokens) if num_prompt is None else num_prompt
    group = SequenceGroup.create(0, tokens[:num_prompt], [SamplingParams(seed=0)], first_seq_id=0)
    seq = group.seqs[0]
    seq.output_ids.extend(tokens[num_prompt:])
    return seq


def _brute_force(tokens: list[int], k: int, ngram_min: int, ngram_max: int) -> list[int]:
    for n in range(min(ngram_max, len(tokens) - 1), ngram_min - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for end in range(len(tokens) - 2, n - 2, -1):  # latest earlier occurrence first
            if tokens[end - n + 1:end + 1] == suffix:
                return tokens[end + 1:end + 1 + k]
    return []


@pytest.mark.parametrize(
    "drafts, sampled, accepted",
    [([], [5], 0), ([5, 6], [5, 6, 7], 2), ([5, 6], [5, 9, 7], 1), ([5, 6], [4, 6, 7], 0), ([5, 5, 5], [5, 5, 4, 5], 2)],
)
def test_accept_rule_keeps_the_agreeing_prefix(drafts, sampled, accepted) -> None:
    assert accepted_drafts(drafts, sampled) == accepted


def test_blocks_after_verify_keeps_the_blocks_of_the_known_tokens() -> None:
    assert blocks_after_verify(9, 4, 4) == 3  # block 3 held only rejected drafts
    assert blocks_after_verify(8, 2, 4) == 2  # all drafts kept: the next step's append_slot grows it


def test_ngram_lookup_finds_the_latest_longest_match() -> None:
    index = NgramIndex(1, 3)
    #              0  1  2  3  4  5  6  7  8  9
    seq = _seq([1, 2, 3, 4, 9, 2, 3, 5, 7, 2, 3], num_prompt=6)
    assert index.propose(seq, 3) == [5, 7, 2]  # "2 3" last occurred at 5..6, then 5 7 2
    seq.output_ids.extend([5, 7])  # ... 2 3 5 7: "3 5 7" occurred at 6..8
    assert index.propose(seq, 4) == [2, 3, 5, 7]
    assert NgramIndex(2, 3).propose(_seq([1, 2, 3, 4]), 2) == []  # no repeated bigram
    assert NgramIndex(1, 1).propose(_seq([8, 1, 2, 3, 1]), 5) == [2, 3, 1]  # stops at the known tokens


def test_incremental_index_equals_a_brute_force_search() -> None:
    rng = random.Random(3)
    for trial in range(30):
        tokens = [rng.randrange(6) for _ in range(rng.randrange(2, 12))]
        seq = _seq(tokens)
        ngram_min = rng.randrange(1, 3)
        index = NgramIndex(ngram_min, ngram_min + rng.randrange(3))
        for _ in range(25):
            k = rng.randrange(1, 6)
            assert index.propose(seq, k) == _brute_force(seq.token_ids, k, index.ngram_min, index.ngram_max)
            seq.output_ids.extend(rng.randrange(6) for _ in range(rng.randrange(1, 4)))


def _cyclic_shard(block_size: int, num_blocks: int, num_host_blocks: int = 0) -> FakeShard:
    """A fake model that mostly repeats a cycle (drafts are right) and sometimes does not (rejections)."""
    shard = FakeShard(block_size, num_blocks, num_host_blocks)
    shard.remap = lambda rid, index, token: token if token % 5 == 0 else 900 + index % 7
    return shard


def _reference(prompt: list[int], seed: int, num_new: int) -> list[int]:
    shard = _cyclic_shard(4, 64)
    scheduler = Scheduler(SchedulerConfig(block_size=4, num_blocks=64))
    group = SequenceGroup.create(99, prompt, [SamplingParams(seed=seed)], first_seq_id=990)
    scheduler.add(group)
    Driver(scheduler, shard, num_new).run()
    return group.seqs[0].output_ids


def _run(num_blocks: int, speculate: int, prompts: list[list[int]], num_new: int, num_host_blocks: int = 0,
         limit: int = 100) -> tuple[list[list[int]], Scheduler, Driver]:
    shard = _cyclic_shard(4, num_blocks, num_host_blocks)
    scheduler = Scheduler(SchedulerConfig(block_size=4, num_blocks=num_blocks, num_host_blocks=num_host_blocks,
                                          max_batch_prefill_tokens=64))
    if speculate:
        scheduler.speculator = Speculator(SpeculateConfig(speculate), lambda seq: min(limit, num_new - seq.num_generated - 1))
    groups = [SequenceGroup.create(i, p, [SamplingParams(seed=i)], first_seq_id=10 * i) for i, p in enumerate(prompts)]
    for group in groups:
        scheduler.add(group)
    driver = Driver(scheduler, shard, num_new)
    driver.run()
    assert scheduler.block_manager.num_used_blocks == 0
    return [g.seqs[0].output_ids for g in groups], scheduler, driver


def test_speculation_gives_plain_decodings_tokens_in_fewer_steps() -> None:
    prompts = [[900 + i % 7 for i in range(9)], [1, 2, 3], [5, 6, 7, 8, 9, 10, 11]]
    outputs, scheduler, driver = _run(64, 4, prompts, 30)
    plain, _, plain_driver = _run(64, 0, prompts, 30)
    assert outputs == plain
    assert outputs[0] == _reference(prompts[0], 0, 30)
    stats = scheduler.speculator.stats
    assert stats.accepted_tokens > 20 and stats.draft_tokens > stats.accepted_tokens  # both kinds happened
    assert driver.num_steps < plain_driver.num_steps
    assert all(len(out) == 30 for out in outputs)  # never past max_new_tokens


@pytest.mark.parametrize("num_host_blocks", [0, 16], ids=["recompute", "swap"])
def test_speculation_under_preemption(num_host_blocks: int) -> None:
    prompts = [[900 + (i + j) % 7 for j in range(6 + i)] for i in range(6)]
    outputs, scheduler, _ = _run(14, 4, prompts, 24, num_host_blocks)
    plain, _, _ = _run(64, 0, prompts, 24)
    assert outputs == plain
    assert scheduler.stats.preemptions_swap + scheduler.stats.preemptions_recompute > 0
    assert scheduler.speculator.stats.accepted_tokens > 0


def _after_prefill(num_blocks: int, budget: int, limit: int = 100):  # noqa: ANN202
    """A sequence of 1 2 1 2 1 2 1 whose first sampled token is 2 (8 tokens, 2 full blocks of 4);
    the plan of its first decode step."""
    scheduler = Scheduler(SchedulerConfig(block_size=4, num_blocks=num_blocks, max_batch_prefill_tokens=budget))
    scheduler.speculator = Speculator(SpeculateConfig(8), lambda seq: limit)
    group = SequenceGroup.create(0, [1, 2, 1, 2, 1, 2, 1], [SamplingParams(seed=0)], first_seq_id=0)
    scheduler.add(group)
    shard = FakeShard(4, num_blocks)
    shard.remap = lambda rid, index, token: 2
    while not group.seqs[0].output_ids:  # the prefill, in chunks as the budget allows
        plan = scheduler.schedule()
        scheduler.update(plan, shard.step(plan))
    return scheduler.schedule().running_requests[0]


def test_drafts_take_only_spare_blocks_budget_and_what_the_engine_allows() -> None:
    request = _after_prefill(num_blocks=8, budget=64)
    # "2 1 2" last occurred at 3..5: the tokens after it, up to the known end.
    assert (request.draft_token_ids, request.num_compute, len(request.new_block_ids)) == ([1, 2], 3, 1)
    request = _after_prefill(num_blocks=3, budget=64)  # the free block is kept for its next token
    assert (request.draft_token_ids, request.num_compute, request.new_block_ids) == ([], 1, [])
    assert len(_after_prefill(num_blocks=8, budget=2).draft_token_ids) == 1  # one token of budget left
    assert _after_prefill(num_blocks=8, budget=64, limit=0).draft_token_ids == []  # e.g. max_new_tokens


def test_a_wrong_accept_rule_changes_the_tokens(monkeypatch) -> None:
    """The identity above is sensitive: accepting one draft too many (on both sides) is caught."""
    import fake_shard

    import loom_router.core.speculate as speculate

    def too_generous(drafts: list[int], sampled: list[int]) -> int:
        return min(len(drafts), accepted_drafts(drafts, sampled) + 1)

    monkeypatch.setattr(speculate, "accepted_drafts", too_generous)
    monkeypatch.setattr(fake_shard, "accepted_drafts", too_generous)
    prompts = [[900 + i % 7 for i in range(9)], [1, 2, 3]]
    plain, _, _ = _run(64, 0, prompts, 30)
    try:
        outputs, _, _ = _run(64, 4, prompts, 30)
    except AssertionError as err:  # the fake shard saw a kept token whose KV is a rejected draft's
        assert "blocks were overwritten" in str(err)
    else:
        assert outputs != plain


def test_no_drafts_on_a_one_token_prefill_chunk() -> None:
    scheduler = Scheduler(SchedulerConfig(block_size=4, num_blocks=16, max_batch_prefill_tokens=8))
    scheduler.speculator = Speculator(SpeculateConfig(4), lambda seq: 100)
    decoding = SequenceGroup.create(0, [1, 2, 1, 2, 1, 2], [SamplingParams(seed=0)], first_seq_id=0)
    scheduler.add(decoding)
    shard = FakeShard(4, 16)
    shard.remap = lambda rid, index, token: 1
    plan = scheduler.schedule()
    scheduler.update(plan, shard.step(plan))
    scheduler.add(SequenceGroup.create(1, [1, 2, 1, 2, 1, 2, 1, 2, 1], [SamplingParams(seed=1)], first_seq_id=10))
    for _ in range(4):  # the newcomer's prompt runs in chunks beside the drafted decodes, some of 1 token
        plan = scheduler.schedule()
        for request in plan.running_requests:
            seq = scheduler.live_seq(request.request_id)
            assert not request.draft_token_ids or seq.num_to_compute == 1
        scheduler.update(plan, shard.step(plan))
