"""Cost of the router + gRPC hop per decode step: full stack against the engine in-process.

    python bench/bench_overhead.py [--batch 1 32] [--steps 48]

In-process: `ModelRunner.step` on a plan of `batch` decoding sequences, timed per step.
Full stack: `batch` concurrent streaming OpenAI completions (ignore_eos, greedy) through
`loom-launcher`; the median time between tokens is the full stack's decode step.
Both run the embedded model with the same dtype, threads and prompt length, one after
the other, so the ratio is measured in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx
import torch

from common import launcher, machine

from loom.common.step import NewRequest, RunningRequest, SamplingParams, StepPlan
from loom.shard.config import ShardConfig
from loom.shard.runner import ModelRunner

PROMPT_TOKENS = 64


def prompt_ids(i: int, vocab: int) -> list[int]:
    return [(1000 + 37 * i + 11 * j) % vocab for j in range(PROMPT_TOKENS)]


def in_process_step_ms(runner: ModelRunner, batch: int, steps: int) -> float:
    """Median decode step time of `batch` sequences, runner called directly."""
    block_size = runner.block_size
    blocks_per_seq = -(-(PROMPT_TOKENS + steps + 8) // block_size)
    vocab = runner.info().vocab_size
    base = 1_000_000 * batch
    new = [NewRequest(base + i, prompt_ids(i, vocab), PROMPT_TOKENS, 0, PROMPT_TOKENS,
                      list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)), SamplingParams(seed=i))
           for i in range(batch)]
    runner.step(StepPlan(new_requests=new))
    running = [RunningRequest(base + i, 1) for i in range(batch)]
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        runner.step(StepPlan(running_requests=running))
        times.append(time.perf_counter() - start)
    runner.release([base + i for i in range(batch)])
    return statistics.median(times[3:]) * 1000


async def full_stack_step_ms(url: str, batch: int, steps: int, vocab: int) -> float:
    """Median time between streamed tokens with `batch` requests decoding together."""
    async def one(client: httpx.AsyncClient, i: int) -> list[float]:
        body = {"model": "loom", "prompt": prompt_ids(i, vocab), "max_tokens": steps, "temperature": 0,
                "ignore_eos": True, "stream": True}
        stamps: list[float] = []
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if line.startswith("data:") and "[DONE]" not in line and json.loads(line[5:])["choices"]:
                    stamps.append(time.perf_counter())
        return [b - a for a, b in zip(stamps, stamps[1:])][3:-3]

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        gaps = await asyncio.gather(*(one(client, i) for i in range(batch)))
    return statistics.median(g for gs in gaps for g in gs) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    runner = ModelRunner(ShardConfig(model_id="", uds_path="", dtype=args.dtype))
    runner.warmup(512, max_batch_total_tokens=16384)
    vocab = runner.info().vocab_size
    dtype = runner.info().dtype
    local = {b: in_process_step_ms(runner, b, args.steps) for b in args.batch}
    del runner

    flags = ["--num-threads", str(args.threads), "--max-batch-total-tokens", "16384", "--dtype", dtype]
    with launcher(*flags) as url:
        asyncio.run(full_stack_step_ms(url, 1, 8, vocab))  # warm up
        stack = {b: asyncio.run(full_stack_step_ms(url, b, args.steps, vocab)) for b in args.batch}

    print(f"machine: {machine()}; dtype {dtype}; {args.threads} threads; prompt {PROMPT_TOKENS} tokens")
    print("| batch | engine step ms | full stack step ms | overhead ms | overhead % |")
    print("|---|---|---|---|---|")
    for b in args.batch:
        extra = stack[b] - local[b]
        print(f"| {b} | {local[b]:.2f} | {stack[b]:.2f} | {extra:.2f} | {100 * extra / local[b]:.1f} |")


if __name__ == "__main__":
    main()
