"""Cost of --otlp-endpoint per step: the tracing code alone, and a real decode step with and
without the shard's spans.

    python bench/bench_tracing.py [--batch 32] [--steps 24] [--dtype bfloat16]

- router: RequestTracer.step (the `step` span, current while the step runs) + grpc_metadata
  (the W3C traceparent injected for the shards), per step, on a plan of `batch` decodes;
- shard: ShardTracer.step (context extracted from that metadata, `shard.step` and its three
  phase spans created), per step;
- decode: ModelRunner.step on the embedded model, `batch` sequences decoding, steps alternating
  untraced (phases None: the path with the flag unset) and traced (inside ShardTracer.step).
Spans go to a BatchSpanProcessor with an in-memory exporter: its export thread runs as it
would, without a collector's network time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import UTC, datetime

import torch
from common import machine
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from loom_proto.config import ShardConfig
from loom_proto.step import NewRequest, RunningRequest, SamplingParams, StepPlan
from loom_router.observability.tracing import RequestTracer
from loom_shard.runtime.runner import ModelRunner
from loom_shard.tracing import ShardTracer

PROMPT_TOKENS = 32


def provider() -> TracerProvider:
    p = TracerProvider()
    p.add_span_processor(BatchSpanProcessor(InMemorySpanExporter(), max_queue_size=1 << 20))
    return p


def tracing_only_us(batch: int, repeats: int = 2000) -> tuple[float, float]:
    """Median µs per step of the router's and the shard's tracing code alone."""
    router, shard = RequestTracer(provider()), ShardTracer(provider(), rank=0)
    plan = StepPlan(running_requests=[RunningRequest(i, 1) for i in range(batch)])
    ids = list(range(batch))
    router_s, shard_s = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        with router.step(plan, ids):
            metadata = router.grpc_metadata()
            middle = time.perf_counter()
            with shard.step(metadata, plan) as phases:
                now = time.perf_counter()
                phases.start = phases.forward_start = phases.sample_start = phases.end = now
            shard_end = time.perf_counter()
        end = time.perf_counter()
        shard_s.append(shard_end - middle)
        router_s.append(end - start - (shard_end - middle))
    return statistics.median(router_s) * 1e6, statistics.median(shard_s) * 1e6


def decode_steps_ms(batch: int, steps: int, dtype: str) -> tuple[float, float]:
    """Median ms of a decode step untraced and traced (alternating, same sequences)."""
    runner = ModelRunner(ShardConfig(model_id="", uds_path="", dtype=dtype, device="cpu",
                                     max_batch_total_tokens=batch * (PROMPT_TOKENS + 2 * steps + 32)))
    warm = runner.warmup(PROMPT_TOKENS * batch, None)
    blocks = -(-(PROMPT_TOKENS + 2 * steps + 8) // warm.block_size)
    vocab = runner.info().vocab_size
    new = [NewRequest(i, [(100 + 7 * i + j) % vocab for j in range(PROMPT_TOKENS)], PROMPT_TOKENS, 0,
                      PROMPT_TOKENS, list(range(i * blocks, (i + 1) * blocks)), SamplingParams(seed=i))
           for i in range(batch)]
    runner.step(StepPlan(new_requests=new))
    tracer = ShardTracer(provider(), rank=0)
    metadata = (("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),)
    plan = StepPlan(running_requests=[RunningRequest(i, 1) for i in range(batch)])
    plain, traced = [], []
    for _ in range(steps):
        start = time.perf_counter()
        runner.step(plan)
        plain.append(time.perf_counter() - start)
        start = time.perf_counter()
        with tracer.step(metadata, plan) as phases:
            runner.step(plan, phases)
        traced.append(time.perf_counter() - start)
    return statistics.median(plain[2:]) * 1e3, statistics.median(traced[2:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    print(f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    router_us, shard_us = tracing_only_us(args.batch)
    print(f"tracing code per step, batch {args.batch}: router {router_us:.0f} µs, shard {shard_us:.0f} µs")
    plain_ms, traced_ms = decode_steps_ms(args.batch, args.steps, args.dtype)
    print(f"decode step, batch {args.batch}, {args.dtype}: untraced {plain_ms:.2f} ms, traced {traced_ms:.2f} ms "
          f"({(traced_ms / plain_ms - 1) * 100:+.1f}%)")


if __name__ == "__main__":
    main()
