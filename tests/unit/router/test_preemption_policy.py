"""Preemption under sustained pressure: the newest arrival is the victim, never an older request
for a newer one, so a long request competing with a stream of short ones still finishes."""

from __future__ import annotations

from fake_shard import FakeShard
from test_scheduler import assert_reference_outputs, group

from loom_router.core.request import SequenceGroup
from loom_router.core.scheduler import Scheduler, SchedulerConfig

LONG_NEW, SHORT_NEW = 40, 6


def test_long_request_is_never_preempted_by_newer_short_ones():
    for num_host_blocks in (0, 16):
        scheduler = Scheduler(SchedulerConfig(block_size=4, num_blocks=16, num_host_blocks=num_host_blocks,
                                              max_batch_prefill_tokens=16))
        shard = FakeShard(4, 16, num_host_blocks)
        preemptions = record_preemptions(scheduler)
        early = [group(0, [1, 2, 3, 4, 5]), group(1, [6, 7, 8, 9, 10])]  # older than the long one
        long = group(2, list(range(100, 112)))
        limits = {2: LONG_NEW}
        groups = [*early, long]
        for g in groups:
            scheduler.add(g)
        steps = 0
        while scheduler.has_work():
            if steps < 300 and steps % 3 == 0:  # a short request every third step
                short = group(10 + steps, [steps % 900 + 1, 7, 7])
                scheduler.add(short)
                groups.append(short)
            run_step(scheduler, shard, limits)
            steps += 1
            assert steps < 5_000, "a request never finished"
        assert preemptions, "no pressure: the test shows nothing"
        for victim, still_running in preemptions:
            newer = [g.group_id for g in still_running if _arrival(g) > _arrival(victim)]
            assert newer == [], f"group {victim.group_id} preempted while newer {newer} kept running"
        assert all(g.is_finished for g in groups)
        assert_reference_outputs(long, LONG_NEW)
        for g in groups:
            if g is not long:
                assert_reference_outputs(g, SHORT_NEW)


def record_preemptions(scheduler: Scheduler) -> list[tuple[SequenceGroup, list[SequenceGroup]]]:
    """Every preemption with the groups that stayed running (wraps Scheduler._preempt)."""
    seen: list[tuple[SequenceGroup, list[SequenceGroup]]] = []
    preempt = scheduler._preempt

    def recording(victim, step):  # noqa: ANN001, ANN202
        preempt(victim, step)
        seen.append((victim, list(scheduler._running.values())))

    scheduler._preempt = recording  # type: ignore[method-assign]
    return seen


def run_step(scheduler: Scheduler, shard: FakeShard, limits: dict[int, int]) -> None:
    plan = scheduler.schedule()
    if plan is None:
        return
    result = shard.step(plan)
    shard.verify()
    for seq, out in scheduler.update(plan, result):
        if out.token_id is not None and seq.num_generated >= limits.get(seq.group.group_id, SHORT_NEW):
            scheduler.finish(seq)


def _arrival(g: SequenceGroup) -> tuple[float, int]:
    return g.arrival_time, g.group_id
