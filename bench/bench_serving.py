"""HTTP load generator: streaming greedy completions at several concurrencies against a real launcher.

    python bench/bench_serving.py                     # starts loom-launcher on the embedded model
    python bench/bench_serving.py --url http://...    # or measures a running server

Prints tokens/s, time to first token and time between tokens per concurrency, as
MODEL-NOTES.md measured llama.cpp's server and transformers on this machine kind.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import httpx
from common import StreamTiming, launcher, machine, percentile, stream_completion, sustained_rate

# A ~150-token prompt, varied per request so the prefix cache doesn't make prefill free.
BASE_PROMPT = ("Write a detailed story about a lighthouse keeper who finds a message in a bottle. "
               "Describe the weather, the sea, the keeper's daily routine, the old radio, the gulls, "
               "the supply boat that comes every second Tuesday, and the keeper's memories of the "
               "mainland town where she grew up, with its bakery, its school and its small harbour. ") * 2


async def run_level(url: str, concurrency: int, num_requests: int, new_tokens: int) -> list[StreamTiming]:
    # ignore_eos: every request streams exactly new_tokens, as in MODEL-NOTES' measurements.
    params = {"max_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(num_requests):
        queue.put_nowait(i)
    results: list[StreamTiming] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            i = queue.get_nowait()
            results.append(await stream_completion(client, {"prompt": f"Request {i}. {BASE_PROMPT}", **params}))

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return results


def arrivals(results: list[StreamTiming]) -> list[tuple[float, float]]:
    """(time, tokens) of every event, an event's tokens spread evenly over the gap before it."""
    out: list[tuple[float, float]] = []
    for r in results:
        per_event = r.num_tokens / max(len(r.token_times), 1)
        out += [(r.started + t, per_event) for t in r.token_times]
    return out


def report(concurrency: int, results: list[StreamTiming], wall_s: float) -> str:
    tokens = sum(r.num_tokens for r in results)
    ttft = [r.ttft_s for r in results]
    itl = [t for r in results for t in r.inter_token_s]
    events = sum(len(r.token_times) for r in results)
    return (f"| {concurrency} | {len(results)} | {tokens / wall_s:.1f} | {sustained_rate(arrivals(results)):.1f} | "
            f"{tokens / max(events, 1):.2f} | {statistics.median(ttft) * 1000:.0f} | "
            f"{percentile(ttft, 0.99) * 1000:.0f} | {statistics.median(itl) * 1000:.1f} | "
            f"{percentile(itl, 0.99) * 1000:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server; default: start loom-launcher")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests-per-level", type=int, default=0, help="default: 2 x concurrency (min 4)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--launcher-flag", action="append", default=[], help="extra flag for loom-launcher")
    args = parser.parse_args()

    def run(url: str) -> None:
        asyncio.run(run_level(url, 1, 1, 8))  # warm the path once
        print(f"machine: {machine()}")
        print("| concurrency | requests | tokens/s | sustained tokens/s (p10-p90) | tokens per event | "
              "TTFT median ms | TTFT p99 ms | time between events median ms | p99 ms |")
        print("|---|---|---|---|---|---|---|---|---|")
        for c in args.concurrency:
            n = args.requests_per_level or max(4, 2 * c)
            start = time.perf_counter()
            results = asyncio.run(run_level(url, c, n, args.new_tokens))
            print(report(c, results, time.perf_counter() - start), flush=True)

    if args.url:
        run(args.url)
    else:
        with launcher(*args.launcher_flag) as url:
            run(url)


if __name__ == "__main__":
    main()
