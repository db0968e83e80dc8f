"""A step launched while the one before it still computes, on CUDA (tests/unit/shard/
test_launch_ahead.py checks the bookkeeping on the CPU): the outputs are those of steps run one
at a time, eagerly and through CUDA graphs, and launching a greedy decode step makes no
synchronizing call (it queues its work behind the step before without waiting for it)."""

from __future__ import annotations

import warnings

import pytest
import torch

from loom_proto.config import ShardConfig
from loom_shard.runtime.runner import ModelRunner
from tests.unit.shard.conftest import make_pair
from tests.unit.shard.test_launch_ahead import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    PARAMS,
    decode_plans,
    launched_ahead,
    one_at_a_time,
)


def _runner(cuda_graphs: bool) -> ModelRunner:
    config = ShardConfig(model_id="tiny", uds_path="", device="cuda", dtype="float32", block_size=BLOCK_SIZE,
                         cuda_graphs=cuda_graphs)
    runner = ModelRunner(config, model=make_pair("llama").loom)
    runner.allocate_kv_cache(num_blocks=NUM_BLOCKS, num_host_blocks=0)
    return runner


@pytest.mark.parametrize("graphs", [False, True])
def test_steps_launched_ahead_give_the_outputs_of_steps_one_at_a_time(graphs: bool) -> None:
    plans = decode_plans(list(PARAMS.values()), num_decodes=12)
    assert launched_ahead(_runner(graphs), plans) == one_at_a_time(_runner(graphs), plans)


def test_launching_a_greedy_decode_waits_for_nothing() -> None:
    runner = _runner(cuda_graphs=True)
    plans = decode_plans([PARAMS["greedy with alternatives"]] * 4, num_decodes=5)
    runner.step(plans[0])
    first = runner.launch(plans[1])
    runner.finish(runner.launch(plans[2]))  # a step launched ahead once before counting (first calls)
    assert first.result is not None
    in_flight = runner.launch(plans[3])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            ahead = runner.launch(plans[4])
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert [str(w.message) for w in caught if "synchroniz" in str(w.message)] == []
    assert runner.finish(in_flight).outputs and runner.finish(ahead).outputs
    assert runner.step_graphs is not None and runner.step_graphs.num_replays >= 3
