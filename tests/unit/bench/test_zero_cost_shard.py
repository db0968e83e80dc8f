"""The ceiling benchmark's zero-cost shard answers the router's plans as the contract says: one
token for each sequence whose prompt is done, whichever part of the plan names it."""

from __future__ import annotations

import sys
from pathlib import Path

from loom_proto.codec import from_pb, pb
from loom_proto.step import NewRequest, RunningRequest, SamplingParams, StepPlan
from loom_proto.wire import encode_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
from zero_cost_shard import ZeroCostShard  # noqa: E402


def step(shard: ZeroCostShard, plan: StepPlan) -> dict[int, int | None]:
    result = from_pb(pb.StepResult.FromString(shard.step(encode_plan(plan))))
    return {out.request_id: out.token_id for out in result.outputs}


def new(request_id: int, num_prompt: int, num_compute: int) -> NewRequest:
    return NewRequest(request_id, list(range(1, num_prompt + 1)), num_prompt, 0, num_compute, [0, 1],
                      SamplingParams(seed=0))


def test_one_token_per_sequence_whose_prompt_is_done() -> None:
    shard = ZeroCostShard(block_size=16)
    first = step(shard, StepPlan(new_requests=[new(1, 4, 4), new(2, 8, 4)]))
    assert list(first) == [1]  # request 2 computed half its prompt
    second = step(shard, StepPlan(running_requests=[RunningRequest(1, 1), RunningRequest(2, 4, [2])]))
    third = step(shard, StepPlan(running_requests=[RunningRequest(1, 1, [3]), RunningRequest(2, 1)]))
    assert sorted(second) == sorted(third) == [1, 2]  # plain decodes (decode_ids) and messages alike
    assert all(token is not None for token in [*second.values(), *third.values()])


def test_released_sequences_are_forgotten() -> None:
    shard = ZeroCostShard(block_size=16)
    step(shard, StepPlan(new_requests=[new(1, 4, 4)]))
    step(shard, StepPlan(released_ids=[1]))
    assert shard.seqs.seqs == {}
