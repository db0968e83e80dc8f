"""The shard's host work per decode step at large batches: what a step costs besides the model.

Run: python bench/bench_step_overhead.py [--batches 32 256] [--steps 100] [--threads 2] [--graph-host]

A tiny random Llama (hidden 64, 2 layers, float32) decodes `batch` sequences through what a step
on the step socket does: the plan's bytes parsed, `ModelRunner.step`, the result written. Its
forward costs little, so the step time is mostly the host's per-sequence work: on a GPU that work
is on every step's critical path (a 256-sequence step there takes a few ms). Reported: the mean
step, per sequence, and the runner's phases (plan check, admission, forward, sampling, the samples
read back, wire).
With --graph-host the forward is what a CUDA graph step costs the host (its padding, step tables
and input copies through `StepGraphs`, the replay itself left out): the whole step is then the
host work a GPU waits on.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from bench.bench_engine import make_runner  # noqa: E402
from bench.bench_moe import random_model  # noqa: E402
from bench.common import machine  # noqa: E402
from loom_proto.codec import from_pb, pb, to_pb  # noqa: E402
from loom_proto.event_loop import freeze_startup_heap  # noqa: E402
from loom_proto.step import NewRequest, RunningRequest, SamplingParams, StepPlan  # noqa: E402
from loom_proto.wire import encode_plan  # noqa: E402
from loom_shard.model_config import ModelConfig  # noqa: E402
from loom_shard.runtime import plan_check  # noqa: E402
from loom_shard.runtime.cuda_graphs import GraphSpec, StepGraphs, graph_token_sizes  # noqa: E402
from loom_shard.runtime.runner import ModelRunner  # noqa: E402

TINY = ModelConfig(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, max_position_embeddings=4096, intermediate_size=128)
BLOCKS_PER_SEQ = 16  # 256 tokens at the runner's block size


def timed(totals: dict[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start
    return wrapper


class _NoReplay:
    def replay(self) -> None:
        pass


class HostOnlyGraphs(StepGraphs):
    """A graph step's host work on the CPU: padding, step tables and input copies; no replay."""

    def _record(self, forward, pool):  # noqa: ANN001, ANN202
        return _NoReplay(), forward()  # hidden states of the bucket's shape, computed once


def host_only_graphs(runner: ModelRunner, scratch_block: int) -> StepGraphs:
    max_blocks = TINY.max_position_embeddings // runner.block_size
    sizes = graph_token_sizes(256, max_blocks, runner.block_size)
    spec = GraphSpec(runner.block_size, max_blocks, max_blocks * runner.block_size - 1, scratch_block, sizes)
    graphs = HostOnlyGraphs(runner.model, runner.kv_cache.device_blocks, runner.attention.kernel, spec)
    with torch.inference_mode():
        graphs.capture()
    return graphs


def measure(batch: int, steps: int, graph_host: bool = False) -> tuple[float, dict[str, float]]:
    runner: ModelRunner = make_runner(random_model(TINY), "float32", batch * BLOCKS_PER_SEQ + 64)
    if graph_host:
        runner.step_graphs = host_only_graphs(runner, scratch_block=batch * BLOCKS_PER_SEQ)
    rng = random.Random(0)
    runner.step(StepPlan(new_requests=[
        NewRequest(i, [rng.randrange(1, TINY.vocab_size) for _ in range(20)], 20, 0, 20,
                   list(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ)), SamplingParams(seed=i))
        for i in range(batch)]))
    data = encode_plan(StepPlan(running_requests=[RunningRequest(i, 1) for i in range(batch)]))
    totals: dict[str, float] = defaultdict(float)
    check = plan_check.PlanCheck.validate
    plan_check.PlanCheck.validate = timed(totals, "plan check", check)  # type: ignore[method-assign]
    for name in ("_admit", "_forward", "_sample", "_read_samples"):
        setattr(runner, name, timed(totals, name.strip("_"), getattr(runner, name)))
    try:
        for _ in range(3):  # warm
            runner.step(from_pb(pb.StepPlan.FromString(data)))
        freeze_startup_heap()  # as the shard does once it serves: collections scan what steps allocate
        totals.clear()
        start = time.perf_counter()
        for _ in range(steps):
            plan = timed(totals, "plan bytes", lambda: from_pb(pb.StepPlan.FromString(data)))()
            result = runner.step(plan)
            timed(totals, "result bytes", lambda: to_pb(result).SerializeToString())()  # noqa: B023
        elapsed = (time.perf_counter() - start) / steps
    finally:
        plan_check.PlanCheck.validate = check  # type: ignore[method-assign]
    return elapsed, {name: total / steps for name, total in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--graph-host", action="store_true", help="the forward as a CUDA graph step's host work")
    parser.add_argument("--profile", action="store_true", help="print the widest batch's cProfile")
    parser.add_argument("--profile-sort", default="tottime", help="pstats order: tottime, cumulative")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"machine: {machine()}")
    for batch in args.batches:
        step_s, phases = measure(batch, args.steps, args.graph_host)
        parts = ", ".join(f"{name} {seconds * 1e3:.3f}" for name, seconds in phases.items())
        print(f"batch {batch}: {step_s * 1e3:.2f} ms a step, {step_s / batch * 1e6:.1f} us a sequence; ms: {parts}")
    if args.profile:
        profile = cProfile.Profile()
        profile.runcall(measure, max(args.batches), args.steps, args.graph_host)
        pstats.Stats(profile).sort_stats(args.profile_sort).print_stats(25)


if __name__ == "__main__":
    main()
