"""Prefix cache and KV budget: cached-prefix TTFT, and concurrency at a fixed KV budget.

    python bench/bench_prefix.py                 # both parts, each on its own loom-launcher (bfloat16)
    python bench/bench_prefix.py --part ttft     # or only one part: ttft | budget

ttft: time to first token (streamed /v1/completions) of a prompt whose 2,000-token prefix is
  cached, against the same prompt cold; each repetition uses a new random prefix, and the
  warm request a new suffix, so only the prefix can hit.
budget: 64 requests at once (prompts 20-600 random tokens, max_new_tokens 16-256, ignore_eos,
  greedy) in a KV budget of 8,192 tokens. loom_running_requests and loom_kv_blocks_used are
  sampled every 50 ms. The baseline is a static per-slot split of the same budget, as
  llama.cpp's --parallel does: every slot must hold max_total_tokens (1,024 here: the longest
  request is 856), so slots = budget // max_total_tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx
from common import launcher, machine, metrics

VOCAB_LOW, VOCAB_HIGH = 300, 40_000  # ordinary token ids of the embedded model's vocabulary


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


# ---- part a: time to first token with a cached prefix ------------------------------------


@dataclass(slots=True)
class Ttft:
    ttft_s: float
    cached_tokens: int


async def stream_ttft(client: httpx.AsyncClient, prompt: list[int], new_tokens: int) -> Ttft:
    """Stream a greedy completion; time its first token, read cached tokens from the usage."""
    body = {"prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft_s, cached = None, 0
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("choices") and ttft_s is None:
                ttft_s = time.perf_counter() - start
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert ttft_s is not None, "no token streamed"
    return Ttft(ttft_s, cached)


async def ttft_pairs(url: str, repeats: int, prefix_tokens: int, seed: int) -> list[tuple[Ttft, Ttft]]:
    rng = random.Random(seed)
    pairs = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await stream_ttft(client, random_ids(rng, 64), 2)  # warm the path
        for _ in range(repeats):
            prefix = random_ids(rng, prefix_tokens)
            cold = await stream_ttft(client, prefix + random_ids(rng, 16), 4)
            warm = await stream_ttft(client, prefix + random_ids(rng, 16), 4)
            pairs.append((cold, warm))
    return pairs


def run_ttft(repeats: int, prefix_tokens: int, seed: int) -> None:
    flags = ("--dtype", "bfloat16", "--max-total-tokens", "4096", "--max-input-tokens", "4000",
             "--max-batch-total-tokens", "16384")
    with launcher(*flags) as url:
        pairs = asyncio.run(ttft_pairs(url, repeats, prefix_tokens, seed))
    cold = statistics.median(c.ttft_s for c, _ in pairs)
    warm = statistics.median(w.ttft_s for _, w in pairs)
    print(f"machine: {machine()}")
    print(f"launcher flags: {' '.join(flags)}")
    print(f"prompt: {prefix_tokens}-token prefix + 16-token suffix, median of {repeats}")
    print()
    print("| request | TTFT ms (median) | TTFT ms (each) | prompt tokens cached |")
    print("|---|---|---|---|")
    print(f"| cold | {cold * 1000:.0f} | {', '.join(f'{c.ttft_s * 1000:.0f}' for c, _ in pairs)} | "
          f"{', '.join(str(c.cached_tokens) for c, _ in pairs)} |")
    print(f"| prefix cached | {warm * 1000:.0f} | {', '.join(f'{w.ttft_s * 1000:.0f}' for _, w in pairs)} | "
          f"{', '.join(str(w.cached_tokens) for _, w in pairs)} |")
    print(f"\nspeed-up (median cold / median cached): {cold / warm:.1f}x")


# ---- part b: concurrency at a fixed KV budget --------------------------------------------


@dataclass(slots=True)
class Samples:
    running: list[float] = field(default_factory=list)
    queued: list[float] = field(default_factory=list)
    blocks_used: list[float] = field(default_factory=list)


async def sample_metrics(client: httpx.AsyncClient, samples: Samples, done: asyncio.Event,
                         period_s: float) -> None:
    while not done.is_set():
        text = (await client.get("/metrics")).text
        values = {}
        for line in text.splitlines():
            if line.startswith(("loom_running_requests ", "loom_queue_size ", "loom_kv_blocks_used ")):
                name, _, value = line.partition(" ")
                values[name] = float(value)
        samples.running.append(values["loom_running_requests"])
        samples.queued.append(values["loom_queue_size"])
        samples.blocks_used.append(values["loom_kv_blocks_used"])
        await asyncio.sleep(period_s)


async def complete(client: httpx.AsyncClient, prompt: list[int], new_tokens: int) -> int:
    body = {"prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    resp = await client.post("/v1/completions", json=body)
    resp.raise_for_status()
    return resp.json()["usage"]["completion_tokens"]


def workload(num_requests: int, seed: int) -> list[tuple[list[int], int]]:
    """Random prompts (random tokens: no shared prefixes) of 20-600 tokens, 16-256 new tokens."""
    rng = random.Random(seed)
    return [(random_ids(rng, rng.randint(20, 600)), rng.randint(16, 256)) for _ in range(num_requests)]


async def budget_run(url: str, requests: list[tuple[list[int], int]]) -> tuple[Samples, float, int]:
    samples, done = Samples(), asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        await complete(client, random_ids(random.Random(0), 32), 2)  # warm the path
        sampler = asyncio.create_task(sample_metrics(client, samples, done, 0.05))
        start = time.perf_counter()
        counts = await asyncio.gather(*(complete(client, p, n) for p, n in requests))
        wall_s = time.perf_counter() - start
        done.set()
        await sampler
    return samples, wall_s, sum(counts)


def run_budget(num_requests: int, budget_tokens: int, max_total_tokens: int, seed: int) -> None:
    flags = ("--dtype", "bfloat16", "--max-batch-total-tokens", str(budget_tokens),
             "--max-total-tokens", str(max_total_tokens), "--max-concurrent-requests", str(2 * num_requests))
    requests = workload(num_requests, seed)
    with launcher(*flags) as url:
        before = metrics(url)
        samples, wall_s, num_tokens = asyncio.run(budget_run(url, requests))
        after = metrics(url)
        num_blocks = after["loom_kv_blocks_total"]
    preempted = {kind: after[f'loom_preemptions_total{{kind="{kind}"}}'] - before[f'loom_preemptions_total{{kind="{kind}"}}']
                 for kind in ("swap", "recompute")}
    busy = [r for r in samples.running if r > 0]
    saturated = [r for r, q in zip(samples.running, samples.queued) if q > 0]
    slots = budget_tokens // max_total_tokens
    print(f"machine: {machine()}")
    print(f"launcher flags: {' '.join(flags)}")
    print(f"workload: {num_requests} requests at once, prompts 20-600 tokens "
          f"(mean {statistics.mean(len(p) for p, _ in requests):.0f}), max_new_tokens 16-256 "
          f"(mean {statistics.mean(n for _, n in requests):.0f}), ignore_eos, greedy; "
          f"{len(samples.running)} samples every 50 ms")
    print()
    print("| server | sequences served concurrently: mean | mean while requests queued | peak |")
    print("|---|---|---|---|")
    print(f"| static split ({budget_tokens} // {max_total_tokens}, as llama.cpp --parallel) | {slots} | {slots} | {slots} |")
    print(f"| Loom, one shared pool of {budget_tokens} tokens | {statistics.mean(busy):.1f} | "
          f"{statistics.mean(saturated) if saturated else float('nan'):.1f} | {max(samples.running):.0f} |")
    print()
    print(f"Loom / static (mean while queued): {statistics.mean(saturated) / slots if saturated else float('nan'):.1f}x; "
          f"wall {wall_s:.1f} s, {num_tokens / wall_s:.0f} generated tokens/s; "
          f"KV blocks used {statistics.mean(samples.blocks_used):.0f} of {num_blocks:.0f} on average; "
          f"preemptions: {preempted['swap']:.0f} swap, {preempted['recompute']:.0f} recompute")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["ttft", "budget", "both"], default="both")
    parser.add_argument("--repeats", type=int, default=3, help="ttft: cold/cached pairs")
    parser.add_argument("--prefix-tokens", type=int, default=2000)
    parser.add_argument("--requests", type=int, default=64, help="budget: requests sent at once")
    parser.add_argument("--budget-tokens", type=int, default=8192)
    parser.add_argument("--max-total-tokens", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=5)
    args = parser.parse_args()
    if args.part in ("ttft", "both"):
        run_ttft(args.repeats, args.prefix_tokens, args.seed)
    if args.part in ("budget", "both"):
        print()
        run_budget(args.requests, args.budget_tokens, args.max_total_tokens, args.seed)


if __name__ == "__main__":
    main()
