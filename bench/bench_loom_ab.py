"""Loom against Loom, at bench_vs_llamacpp's reference load (streaming /v1/completions, greedy,
ignore_eos, ~150-word prompts, 128 new tokens, two requests per stream): two or more variants
taking turns, each run with the same fresh prompts, the order alternating per round. What a
change buys end to end, where a kernel's A/B (bench_kernel_ab.py) cannot say.

    .venv/bin/python bench/bench_loom_ab.py --variant "old,PYTHONPATH=$OLD/proto:$OLD/router:$OLD/shard:$OLD/launcher" \\
        --variant new --concurrency 32 --rounds 6

A variant is "NAME[,ENV=VALUE...][ launcher flags]" (bench_ceiling's form); PYTHONPATH naming an
unpacked `git archive <commit> proto router shard launcher` (with the proto stubs copied in)
measures that commit's code. Prints each run's tokens/s and CPU per token (every process of the
server, from /proc), then per round the last variant's tokens/s over the first's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys

from bench_ceiling import Variant
from bench_vs_llamacpp import WARMUP_SEED, measure, run_requests
from common import ServerURL, launcher, machine, tree_cpu_s


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--variant", action="append", type=Variant.parse, required=True,
                   help='"NAME[,ENV=VALUE...][ flags]"; two or more')
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--prompt-words", type=int, default=150)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--requests-per-stream", type=int, default=2)
    p.add_argument("--min-requests", type=int, default=4)
    return p


async def compare(args: argparse.Namespace, urls: dict[str, ServerURL]) -> dict[str, list[float]]:
    for url in urls.values():
        await measure(url, run_requests(args, 1, WARMUP_SEED)[:2], 1, "warmup")
    rates: dict[str, list[float]] = {name: [] for name in urls}
    for round_ in range(args.rounds):
        names = list(urls) if round_ % 2 == 0 else list(reversed(urls))
        for name in names:
            load, cpu_before = os.getloadavg()[0], tree_cpu_s(urls[name].pid)
            summary = await measure(urls[name], run_requests(args, args.concurrency, 2000 + round_),
                                    args.concurrency, name)
            cpu_ms = (tree_cpu_s(urls[name].pid) - cpu_before) * 1e3 / max(summary.total_output_tokens, 1)
            rates[name].append(summary.output_throughput)
            print(f"round {round_ + 1}/{args.rounds} {name}: {summary.output_throughput:.1f} tokens/s, "
                  f"CPU {cpu_ms:.2f} ms/token, {summary.failed} failed, load average before {load:.2f}", flush=True)
    return rates


def main() -> int:
    args = build_parser().parse_args()
    if len(args.variant) < 2:
        sys.exit("bench_loom_ab: give two or more --variant")
    with contextlib.ExitStack() as stack:
        urls = {v.name: stack.enter_context(launcher(*v.flags, env=v.env)) for v in args.variant}
        rates = asyncio.run(compare(args, urls))
    first, last = args.variant[0].name, args.variant[-1].name
    ratios = [b / a for a, b in zip(rates[first], rates[last])]
    print(f"\n{machine()}; {args.concurrency} streams, {args.rounds} rounds")
    for name, values in rates.items():
        print(f"{name}: {min(values):.1f}-{max(values):.1f} tokens/s, median {statistics.median(values):.1f}")
    print(f"{last} / {first} per round: " + ", ".join(f"{r:.3f}x" for r in ratios)
          + f" (median {statistics.median(ratios):.3f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
