"""Cost of the router + gRPC hop per decode step: full stack against the engine in-process.

    python bench/bench_overhead.py [--batch 1 32] [--steps 48] [--rounds 2] [--no-full-stack]

- engine: `ModelRunner.step` in this process on a plan of `batch` decoding sequences.
- router + gRPC: the router's `Engine` (scheduler, block manager, detokenizer, streams) in
  this process driving a real `loom-shard` subprocess over its unix socket; no HTTP. Measured
  with --overlap-steps off and on, interleaved (off, on, off, on, ...: `--rounds` each), the
  median of each mode's rounds reported.
- full stack: `batch` concurrent streaming OpenAI completions (ignore_eos, greedy) through
  `loom-launcher`, read by an HTTP client on the same machine.
Each is the median time between one sequence's tokens with all `batch` decoding. All run
the embedded model with the same dtype, threads and prompt length, one after the other.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import torch
from common import REPO, launcher, machine

from loom_proto.config import RouterConfig, ShardConfig
from loom_proto.step import NewRequest, RunningRequest, SamplingParams, StepPlan
from loom_router.core.engine import Engine
from loom_router.core.shard_client import ShardClient
from loom_router.tokenizer import load_tokenizer
from loom_router.types import GenerationParams
from loom_shard.runtime.runner import ModelRunner

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
        body = {"prompt": prompt_ids(i, vocab), "max_tokens": steps, "temperature": 0,
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


async def router_step_ms(uds: str, batches: list[int], steps: int, vocab: int, overlap: bool = False,
                         tokens: dict | None = None) -> dict[int, float]:
    """Median time between tokens with the router's engine driving a real shard over gRPC;
    each request's token ids go into `tokens` by (overlap, max_new_tokens, i)."""
    tokens = {} if tokens is None else tokens
    config = RouterConfig(model_id="", shard_uds_paths=(uds,), max_batch_prefill_tokens=512,
                          max_batch_total_tokens=16384, overlap_steps=overlap)
    client = ShardClient([uds])
    await client.wait_ready(300)
    engine = Engine(config, client, load_tokenizer(""))
    await engine.start()

    async def one(i: int, max_new: int) -> list[float]:
        params = GenerationParams([SamplingParams(seed=i)], max_new_tokens=max_new, ignore_eos=True)
        stamps = []
        async for event in engine.submit(prompt_ids(i, vocab), params):
            stamps.append(time.perf_counter())
            tokens.setdefault((overlap, max_new, i), []).append(event.token.token_id)
        return [b - a for a, b in zip(stamps, stamps[1:])][3:-3]

    await one(0, 8)  # warm up
    result = {}
    for batch in batches:
        gaps = await asyncio.gather(*(one(i, steps) for i in range(batch)))
        result[batch] = statistics.median(g for gs in gaps for g in gs) * 1000
    await engine.stop(1.0)
    await client.close()
    return result


def interleaved(uds: str, batches: list[int], steps: int, vocab: int, rounds: int) -> dict[bool, dict[int, float]]:
    """router_step_ms with overlap off and on, alternating; the median of each mode's rounds."""
    runs: dict[bool, list[dict[int, float]]] = {False: [], True: []}
    last: dict = {}
    for _ in range(rounds):
        for overlap in (False, True):
            tokens: dict = {}
            runs[overlap].append(asyncio.run(router_step_ms(uds, batches, steps, vocab, overlap, tokens)))
            same = {key[1:]: ids for key, ids in tokens.items()}
            if overlap:  # greedy: the same token ids with and without lookahead
                assert same == last, "--overlap-steps changed the generated tokens"
            last = same
    print(f"token ids identical with --overlap-steps off and on: {rounds} rounds, {len(last)} requests each")
    return {mode: {b: statistics.median(r[b] for r in rs) for b in batches} for mode, rs in runs.items()}


def with_shard(dtype: str, threads: int, fn) -> dict:  # noqa: ANN001
    """Run fn(uds) against a `loom-shard` subprocess."""
    uds = tempfile.mktemp(prefix="loom-bench-")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "loom_shard.server", "--model-id", "", "--uds-path", uds, "--dtype", dtype]
    shard = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        return fn(uds)
    finally:
        shard.terminate()
        shard.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="overlap off/on rounds, interleaved")
    parser.add_argument("--no-full-stack", action="store_true", help="skip the launcher measurement")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    runner = ModelRunner(ShardConfig(model_id="", uds_path="", dtype=args.dtype))
    runner.warmup(512, max_batch_total_tokens=16384)
    vocab = runner.info().vocab_size
    dtype = runner.info().dtype
    local = {b: in_process_step_ms(runner, b, args.steps) for b in args.batch}
    del runner

    routed = with_shard(dtype, args.threads,
                        lambda uds: interleaved(uds, args.batch, args.steps, vocab, args.rounds))

    stack: dict[int, float] = {}
    if not args.no_full_stack:
        flags = ["--num-threads", str(args.threads), "--max-batch-total-tokens", "16384", "--dtype", dtype]
        with launcher(*flags) as url:
            asyncio.run(full_stack_step_ms(url, 1, 8, vocab))  # warm up
            stack = {b: asyncio.run(full_stack_step_ms(url, b, args.steps, vocab)) for b in args.batch}

    print(f"machine: {machine()}; dtype {dtype}; {args.threads} threads; prompt {PROMPT_TOKENS} tokens; "
          f"{args.rounds} interleaved rounds")
    print("| batch | engine ms | router + gRPC ms | overhead ms (%) | with --overlap-steps ms | overhead ms (%) "
          "| full stack ms |")
    print("|---|---|---|---|---|---|---|")
    for b in args.batch:
        off, on = routed[False][b], routed[True][b]
        full = f"{stack[b]:.2f}" if b in stack else "-"
        print(f"| {b} | {local[b]:.2f} | {off:.2f} | {off - local[b]:.2f} ({100 * (off - local[b]) / local[b]:.1f}) "
              f"| {on:.2f} | {on - local[b]:.2f} ({100 * (on - local[b]) / local[b]:.1f}) | {full} |")


if __name__ == "__main__":
    main()
