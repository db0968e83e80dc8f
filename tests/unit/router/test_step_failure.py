"""A failed step leaves nothing a later step trusts: injected failures in the fake shard with
swaps and releases in the plan; the affected requests end (or recompute), the others stay
exact, and no block leaks."""

from __future__ import annotations

import pytest
from fake_shard import FailAt, FakeShard, ShardFailure, reference_tokens
from test_scheduler import group, setup

from loom_router.core.request import SequenceGroup
from loom_router.core.scheduler import Scheduler
from loom_router.types import client_text

MAX_NEW = 20


def run(scheduler: Scheduler, shard: FakeShard, max_steps: int = 2_000) -> list[tuple[list[int], list[int]]]:
    """The engine's loop: schedule, step, update (or roll back), finish at MAX_NEW tokens."""
    rollbacks = []
    for _ in range(max_steps):
        if not scheduler.has_work():
            return rollbacks
        plan = scheduler.schedule()
        if plan is None:
            continue
        try:
            result = shard.step(plan)
        except ShardFailure:
            rollbacks.append(scheduler.rollback(plan))
            continue
        shard.verify()
        for seq, out in scheduler.update(plan, result):
            if out.token_id is not None and seq.num_generated >= MAX_NEW:
                scheduler.finish(seq)
    raise AssertionError("still busy")


def two_decoders(num_host_blocks: int) -> tuple[Scheduler, FakeShard, SequenceGroup, SequenceGroup]:
    """a and b decode until the 8-block pool runs dry and b (the newest) is preempted."""
    scheduler, shard, _ = setup(num_host_blocks=num_host_blocks, budget=16, max_new_tokens=MAX_NEW)
    a, b = group(0, list(range(1, 10))), group(1, list(range(50, 59)))
    scheduler.add(a)
    scheduler.add(b)
    return scheduler, shard, a, b


def assert_exact(g: SequenceGroup) -> None:
    for seq in g.seqs:
        assert seq.output_ids == reference_tokens(g.prompt_ids, seq.sampling.seed, MAX_NEW)


def assert_nothing_leaks(scheduler: Scheduler, shard: FakeShard) -> None:
    bm = scheduler.block_manager
    assert bm.num_used_blocks == 0 and all(block.ref_count == 0 for block in bm.blocks)
    assert bm.num_free_host_blocks == bm.num_host_blocks and bm.num_pending_hashes == 0
    assert shard.states == {}


@pytest.mark.parametrize("fail_at", list(FailAt))
def test_failed_step_with_a_swap_out_requeues_the_victim_to_recompute(fail_at: FailAt):
    scheduler, shard, a, b = two_decoders(num_host_blocks=8)
    shard.fail_when, shard.fail_at = (lambda plan: bool(plan.swap_out)), fail_at
    rollbacks = run(scheduler, shard)
    (failed, requeued), = rollbacks
    assert failed == [a.group_id] and requeued == [b.group_id]  # a ran in the step, b was swapped out
    assert not b.swapped and b.seqs[0].host_block_table == []
    assert scheduler.stats.preemptions_recompute == 1
    assert_exact(b)  # its host blocks were maybe never written: it recomputed instead of reading them
    assert_nothing_leaks(scheduler, shard)


@pytest.mark.parametrize("fail_at", list(FailAt))
def test_failed_step_with_a_swap_in_forgets_those_blocks(fail_at: FailAt):
    scheduler, shard, a, b = two_decoders(num_host_blocks=8)
    shard.fail_when, shard.fail_at = (lambda plan: bool(plan.swap_in)), fail_at
    rollbacks = run(scheduler, shard)
    (failed, requeued), = rollbacks
    assert failed == [b.group_id] and requeued == []
    assert b.is_finished
    assert_exact(a)
    # b's blocks that came back from the host were cache entries again: no longer.
    again = group(2, list(b.prompt_ids))
    scheduler.add(again)
    run(scheduler, shard)  # the fake shard asserts a prefix hit's blocks hold its tokens
    assert_exact(again)
    assert_nothing_leaks(scheduler, shard)


def test_failed_step_resends_its_releases():
    scheduler, shard, _ = setup(budget=16)
    a, b = group(0, [1, 2, 3]), group(1, [4, 5, 6])
    scheduler.add(a)
    scheduler.add(b)
    while not a.seqs[0].output_ids:
        plan = scheduler.schedule()
        assert plan is not None
        scheduler.update(plan, shard.step(plan))
    scheduler.abort(a.group_id)  # released with the next plan, which fails before running it
    shard.fail_when, shard.fail_at = (lambda plan: bool(plan.released_ids)), FailAt.START
    run(scheduler, shard)
    assert 0 not in shard.states  # a's shard state was dropped by a later plan
    assert_nothing_leaks(scheduler, shard)


def test_failed_step_of_one_request_leaves_the_others_exact():
    scheduler, shard, _ = setup(budget=16, num_blocks=32)
    groups = [group(i, list(range(10 * i + 1, 10 * i + 6)), seeds=[i, 100 + i]) for i in range(4)]
    for g in groups:
        scheduler.add(g)
    shard.fail_when = lambda plan: len(shard.plans) == 5
    (failed, _), = run(scheduler, shard)
    assert failed == [0, 1, 2, 3]  # every group ran in that step
    late = [group(10 + i, list(range(200 + i, 207 + i))) for i in range(3)]
    for g in late:
        scheduler.add(g)
    run(scheduler, shard)
    for g in late:
        assert_exact(g)
    assert_nothing_leaks(scheduler, shard)


@pytest.mark.parametrize(("text", "shown"), [
    ("shard rank 0: UNAVAILABLE: failed to connect to all addresses; last error: UNKNOWN: "
     "unix:/tmp/loom-shard-0.sock: No such file or directory",
     "shard rank 0: UNAVAILABLE: failed to connect to all addresses; last error: UNKNOWN: No such file or directory"),
    ("shard rank 1: UNAVAILABLE: ipv4:10.1.2.3:50051: Connection refused", "shard rank 1: UNAVAILABLE: Connection refused"),
    ("peer [::1]:8080 closed", "peer closed"),
    ("RuntimeError: boom\n  File \"/opt/loom/shard/runner.py\", line 3", "RuntimeError: boom"),
    ("tensor-parallel ranks diverged (ranks [0] ran it; rank 1: 1/2 of a/b)",  # causes and fractions stay
     "tensor-parallel ranks diverged (ranks [0] ran it; rank 1: 1/2 of a/b)"),
])
def test_client_text_keeps_the_cause_without_paths_or_addresses(text: str, shown: str) -> None:
    assert client_text(text) == shown
