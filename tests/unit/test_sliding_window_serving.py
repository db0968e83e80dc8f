"""The router's scheduler driving a real shard runner over a Gemma-3-shaped tiny model (one global
layer, five sliding ones, window 8): the sliding groups' blocks go back to the pool once out of
the window and serve other requests, and every request still gets transformers' greedy tokens."""

from __future__ import annotations

from loom_proto.codec import from_pb, to_pb
from loom_proto.config import ShardConfig
from loom_proto.step import SamplingParams
from loom_router.core.request import SequenceGroup
from loom_router.core.scheduler import Scheduler, SchedulerConfig
from loom_shard.runtime.runner import ModelRunner
from tests.unit.shard.conftest import make_pair, random_tokens
from tests.unit.shard.test_families import greedy_reference

BLOCK_SIZE, NUM_NEW = 4, 12


def test_sliding_blocks_are_dropped_reused_and_the_answers_stay_exact() -> None:
    pair = make_pair("gemma3")
    runner = ModelRunner(ShardConfig(model_id="tiny", uds_path="", dtype="float32", block_size=BLOCK_SIZE),
                         model=pair.loom)
    windows = runner.info().kv_group_windows
    assert windows == (None, 8, 8, 8, 8, 8)
    num_blocks = 140  # full-length KV everywhere: one request of 41 + 12 tokens alone (84 blocks)
    runner.allocate_kv_cache(num_blocks=num_blocks, num_host_blocks=64)
    scheduler = Scheduler(SchedulerConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks, num_host_blocks=64,
                                          max_batch_prefill_tokens=24, kv_group_windows=windows))
    prompts = [random_tokens(41, 50 + i) for i in range(5)]
    for i, prompt in enumerate(prompts):
        scheduler.add(SequenceGroup.create(i, prompt, [SamplingParams(seed=i)], first_seq_id=10 * i))
    # n = 2: a sibling forked from the prompt's last block, each group's
    scheduler.add(SequenceGroup.create(5, prompts[0], [SamplingParams(seed=0)] * 2, first_seq_id=50))
    outputs: dict[int, list[int]] = {seq_id: [] for seq_id in (0, 10, 20, 30, 40, 50, 51)}
    most_running, steps = 0, 0
    while scheduler.has_work():
        plan = scheduler.schedule()
        if plan is None:
            break
        result = runner.step(from_pb(to_pb(plan)))  # through the wire format, as over gRPC
        most_running = max(most_running, scheduler.stats.num_running)
        for seq, out in scheduler.update(plan, result):
            if out.token_id is not None:
                outputs[seq.seq_id].append(out.token_id)
                if len(outputs[seq.seq_id]) == NUM_NEW:
                    scheduler.finish(seq)
        steps += 1
        assert steps < 500
    assert most_running >= 3  # full-length KV would have run them one at a time
    assert scheduler.block_manager.num_used_blocks == 0
    for i, prompt in enumerate(prompts):
        assert outputs[10 * i] == greedy_reference(pair.hf, prompt, NUM_NEW), i
    assert outputs[50] == outputs[51] == outputs[0]
