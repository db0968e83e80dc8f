"""A queue head waiting for space hashes its prompt blocks once, not every step."""

from __future__ import annotations

from fake_shard import FakeShard, reference_tokens
from test_scheduler import group

from loom_router.core.block_manager import chain_hash
from loom_router.core.scheduler import Scheduler, SchedulerConfig


def test_blocked_head_hashes_its_prompt_once():
    scheduler = Scheduler(SchedulerConfig(block_size=4, num_blocks=16, max_batch_prefill_tokens=64))
    shard = FakeShard(4, 16)
    hashed: list[tuple[int, ...]] = []

    def counting_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
        hashed.append(tokens)
        return chain_hash(parent, tokens)

    scheduler.block_manager._hash_fn = counting_hash
    runner = group(0, list(range(1, 41)))  # 10 blocks, then grows
    head = group(1, list(range(500, 532)))  # 8 full blocks: waits until the runner finishes
    scheduler.add(runner)
    scheduler.add(head)
    num_blocked_steps = 0
    while not runner.is_finished:
        plan = scheduler.schedule()
        assert plan is not None
        blocked = not any(r.request_id == 16 for r in plan.new_requests)
        num_blocked_steps += blocked
        for seq, out in scheduler.update(plan, shard.step(plan)):
            if out.token_id is not None and seq.num_generated >= 12:
                scheduler.finish(seq)
    prompt_blocks = {tuple(head.prompt_ids[i:i + 4]) for i in range(0, 32, 4)}
    head_blocks = [tokens for tokens in hashed if tokens in prompt_blocks]
    assert num_blocked_steps >= 10
    assert len(head_blocks) == 8  # each of its blocks hashed once, not once a step
    while scheduler.has_work():
        plan = scheduler.schedule()
        assert plan is not None
        for seq, out in scheduler.update(plan, shard.step(plan)):
            if out.token_id is not None and seq.num_generated >= 12:
                scheduler.finish(seq)
    assert head.seqs[0].output_ids == reference_tokens(head.prompt_ids, 1, 12)
