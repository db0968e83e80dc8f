"""The scheduler with LoRA adapters: at most max_loras_per_batch distinct adapters run at once (a
request for another waits, keeping its place, while others go ahead), and the prefix cache never
shares blocks between adapters, or between an adapter and the base model."""

from __future__ import annotations

from fake_shard import Driver, FakeShard

from loom_proto.step import Pooling, SamplingParams
from loom_router.core.request import SequenceGroup
from loom_router.core.scheduler import Scheduler, SchedulerConfig


def setup(max_loras: int, num_blocks: int = 32) -> tuple[Scheduler, Driver]:
    config = SchedulerConfig(block_size=4, num_blocks=num_blocks, max_batch_prefill_tokens=64,
                             max_loras_per_batch=max_loras)
    scheduler = Scheduler(config)
    return scheduler, Driver(scheduler, FakeShard(4, num_blocks, 0), 4)


def group(group_id: int, prompt: list[int], lora_id: int | None, pooling: Pooling = Pooling.NONE) -> SequenceGroup:
    return SequenceGroup.create(group_id, prompt, [SamplingParams(seed=group_id)], first_seq_id=group_id * 16,
                                lora_id=lora_id, pooling=pooling)


def test_at_most_max_loras_adapters_run_and_the_rest_wait_in_place() -> None:
    scheduler, driver = setup(max_loras=2)
    groups = [group(0, [1, 2, 3], 1), group(1, [4, 5, 6], 2), group(2, [7, 8, 9], 3), group(3, [1, 5, 9], None),
              group(4, [2, 6, 7], 1)]
    for g in groups:
        scheduler.add(g)
    plan = driver.step()
    assert [(r.request_id, r.lora_id) for r in plan.new_requests] == [(0, 1), (16, 2), (48, None), (64, 1)]
    assert {r.lora_id for r in plan.new_requests} - {None} == {1, 2}
    while not groups[0].is_finished or not groups[1].is_finished or not groups[4].is_finished:
        plan = driver.step()
        assert all(r.lora_id != 3 for r in plan.new_requests)  # adapter 3 waits for a free place
    plan = driver.step()
    assert [(r.request_id, r.lora_id) for r in plan.new_requests] == [(32, 3)]
    driver.run()
    assert all(g.is_finished for g in groups)


def test_prefix_cache_is_keyed_by_adapter() -> None:
    scheduler, driver = setup(max_loras=4)
    prompt = list(range(100, 113))  # three full blocks, then one token
    first = group(0, prompt, 1)
    scheduler.add(first)
    driver.run()
    for group_id, lora_id, cached in ((1, 2, 0), (2, None, 0), (3, 1, 12)):
        later = group(group_id, prompt, lora_id)
        scheduler.add(later)
        plan = driver.step()
        assert [r.num_cached for r in plan.new_requests] == [cached], f"adapter {lora_id}"
        driver.run()


def test_mean_pooling_never_starts_from_the_prefix_cache() -> None:
    scheduler, driver = setup(max_loras=1)
    prompt = list(range(50, 59))
    scheduler.add(group(0, prompt, None))
    driver.run()
    scheduler.add(group(1, prompt, None, Pooling.MEAN))
    plan = driver.step()
    assert [(r.num_cached, r.pooling) for r in plan.new_requests] == [(0, Pooling.MEAN)]
