"""Regression: a step whose only work is a prefill chunk that stops early (no logits needed)."""

from __future__ import annotations

from loom_proto.config import ShardConfig
from loom_proto.step import NewRequest, RunningRequest, SamplingParams, StepPlan
from loom_shard.runtime.runner import ModelRunner
from tests.unit.shard.conftest import random_tokens


def test_a_lone_partial_prefill_chunk_then_the_rest(llama_pair) -> None:
    runner = ModelRunner(ShardConfig(model_id="tiny", uds_path="", dtype="float32", block_size=4), model=llama_pair.loom)
    runner.allocate_kv_cache(num_blocks=8, num_host_blocks=0)
    tokens = random_tokens(10, 3)
    new = NewRequest(1, tokens, len(tokens), num_cached=0, num_compute=6, block_table=[0, 1, 2],
                     sampling=SamplingParams(seed=0))
    assert [o.token_id for o in runner.step(StepPlan(new_requests=[new])).outputs] == [None]
    out = runner.step(StepPlan(running_requests=[RunningRequest(1, 4)])).outputs
    assert out[0].token_id is not None
