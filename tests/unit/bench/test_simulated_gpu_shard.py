"""The simulated-GPU shard's runner: the zero-cost shard's answers, a launch that returns before
its step's simulated device time has passed (which a finish waits for), and device time spent
one step after another."""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import replace
from pathlib import Path

from loom_proto.codec import from_pb, pb
from loom_proto.step import NewRequest, RunningRequest, SamplingParams, StepPlan
from loom_proto.wire import encode_plan
from loom_shard.server import ShardServicer

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
from simulated_gpu_shard import Costs, SimulatedRunner  # noqa: E402
from zero_cost_shard import ZeroCostShard  # noqa: E402

DEVICE_S = 0.05


def _runner() -> SimulatedRunner:
    info = from_pb(ZeroCostShard(16).info())
    return SimulatedRunner(replace(info, device="cuda:0"), Costs(0.0, 0.0, 0.0, DEVICE_S, 0.0))


def _plans() -> list[StepPlan]:
    prompts = [NewRequest(r, [1, 2, 3, 4], 4, 0, n, [0], SamplingParams(seed=0)) for r, n in ((1, 4), (2, 2))]
    return [StepPlan(new_requests=prompts), StepPlan(running_requests=[RunningRequest(1, 1), RunningRequest(2, 2)]),
            StepPlan(running_requests=[RunningRequest(1, 1), RunningRequest(2, 1)])]


def test_the_zero_cost_shards_answers() -> None:
    zero, runner = ZeroCostShard(16), _runner()
    for plan in _plans():
        expected = from_pb(pb.StepResult.FromString(zero.step(encode_plan(plan)))).outputs
        got = [out for out in runner.step(plan).outputs if out.token_id is not None]
        assert {o.request_id: o.token_id for o in got} == {o.request_id: o.token_id for o in expected}


def test_a_launch_does_not_wait_for_the_device_and_steps_queue_on_it() -> None:
    runner = _runner()
    first, second, third = _plans()
    runner.step(first)
    start = time.perf_counter()
    launched = [runner.launch(second), runner.launch(third)]
    assert time.perf_counter() - start < DEVICE_S and not launched[0].ready()
    assert launched[1].done_at - launched[0].done_at >= DEVICE_S  # one step after another
    runner.finish(launched[1])
    assert launched[0].ready() and time.perf_counter() - start >= 2 * DEVICE_S


def test_behind_the_server_a_step_launched_ahead_counts_the_devices_time_only() -> None:
    """The real server, launching ahead: the step launched while the one before computes waited
    for no plan (idle 0, though the worker sat waiting for the device), and its time is its own
    device time, not also the rest of the step before's."""
    first, second, third = _plans()
    servicer = ShardServicer(_runner(), launch_ahead=True)

    async def two_in_flight():  # noqa: ANN202
        await servicer.run_step(first, metadata=())
        ahead = asyncio.ensure_future(servicer.run_step(second, metadata=()))
        await asyncio.sleep(DEVICE_S / 5)  # the second step computes
        behind = asyncio.ensure_future(servicer.run_step(third, metadata=()))
        return await ahead, await behind

    try:
        before, result = asyncio.run(two_in_flight())
    finally:
        servicer.close()
    assert before.idle_ms > 0.0  # launched after the first step had finished
    assert result.idle_ms == 0.0
    assert 0.9 * DEVICE_S * 1e3 <= result.total_ms < 1.5 * DEVICE_S * 1e3
