"""n completions: one request with n=8 against 8 separate requests sent at once.

    python bench/bench_n.py                    # starts loom-launcher (bfloat16) on the embedded model
    python bench/bench_n.py --url http://...   # or measures a running server

Every case: OpenAI /v1/completions, a ~300-token prompt given as token ids, 64 new tokens,
ignore_eos, temperature 0.8, seeds seed..seed+7. Cases:
  n=8            one request, n=8: one prefill, the choices share the prompt blocks
  8 identical    8 requests with the same prompt: the scheduler computes the prefix once
  8 different    8 requests whose prompts differ in their first token: no sharing possible
Each repetition of a case starts with a token never used before, so the prefix cache of an
earlier run cannot help. Prompt tokens computed come from /metrics
(loom_prompt_tokens_computed_total deltas); the table shows medians over the repetitions.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
from common import launcher, machine, metrics

COMPUTED = "loom_prompt_tokens_computed_total"
CACHED = "loom_prompt_tokens_cached_total"
TEXT = ("The old lighthouse stood at the end of a long stone pier, and every evening the keeper "
        "climbed its one hundred and twelve steps to light the lamp. She kept a logbook of ships, "
        "storms, gulls and the colour of the sea, and on quiet nights she read letters from her "
        "brother, who sailed cargo ships between distant ports and wrote about markets, harbours, "
        "strange fruit and the people he met. ")
PROMPT_TOKENS = 300
NUM_CHOICES = 8


@dataclass(slots=True)
class CaseResult:
    wall_s: float
    prompt_tokens_computed: float
    prompt_tokens_cached: float
    num_tokens: int  # completion tokens received


def base_prompt(url: str) -> list[int]:
    """PROMPT_TOKENS token ids of TEXT (repeated), tokenized by the server."""
    ids = [t["id"] for t in httpx.post(f"{url}/tokenize", json={"inputs": TEXT * 5}, timeout=60).json()]
    assert len(ids) >= PROMPT_TOKENS, "TEXT too short"
    return ids[:PROMPT_TOKENS]


def fresh_first_tokens() -> Iterator[int]:
    """Token ids (ordinary vocabulary entries) that no earlier prompt of this run started with."""
    return itertools.count(1000, 7)


async def complete(client: httpx.AsyncClient, prompt: list[int], n: int, seed: int, new_tokens: int) -> int:
    body = {"prompt": prompt, "n": n, "seed": seed, "temperature": 0.8, "max_tokens": new_tokens,
            "ignore_eos": True}
    resp = await client.post("/v1/completions", json=body)
    resp.raise_for_status()
    return resp.json()["usage"]["completion_tokens"]


async def run_case(url: str, prompts: list[list[int]], n: int, seed: int, new_tokens: int) -> CaseResult:
    """Send one request per prompt (each with n choices) at once; time until all are done."""
    before = metrics(url)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        start = time.perf_counter()
        counts = await asyncio.gather(*(complete(client, p, n, seed + i, new_tokens)
                                        for i, p in enumerate(prompts)))
        wall_s = time.perf_counter() - start
    after = metrics(url)
    return CaseResult(wall_s, after[COMPUTED] - before[COMPUTED], after[CACHED] - before[CACHED], sum(counts))


def case_prompts(case: str, base: list[int], first_tokens: Iterator[int]) -> tuple[list[list[int]], int]:
    """The prompts of one repetition of a case and the n of each request."""
    if case == "n=8":
        return [[next(first_tokens), *base[1:]]], NUM_CHOICES
    if case == "8 identical":
        prompt = [next(first_tokens), *base[1:]]
        return [prompt] * NUM_CHOICES, 1
    return [[next(first_tokens), *base[1:]] for _ in range(NUM_CHOICES)], 1


def run(url: str, repeats: int, new_tokens: int, seed: int) -> None:
    base = base_prompt(url)
    first_tokens = fresh_first_tokens()
    asyncio.run(run_case(url, [[next(first_tokens), *base[1:32]]], 2, seed, 4))  # warm the path
    cases = ["n=8", "8 identical", "8 different"]
    results: dict[str, list[CaseResult]] = {case: [] for case in cases}
    for _ in range(repeats):  # interleaved, so a load change on the machine hits every case
        for case in cases:
            prompts, n = case_prompts(case, base, first_tokens)
            results[case].append(asyncio.run(run_case(url, prompts, n, seed, new_tokens)))
    print(f"machine: {machine()}")
    print(f"{NUM_CHOICES} completions of {new_tokens} tokens, {PROMPT_TOKENS}-token prompt, "
          f"temperature 0.8, median of {repeats}")
    print()
    print("| case | requests | wall time s | tokens/s | prompt tokens computed | prompt tokens cached |")
    print("|---|---|---|---|---|---|")
    for case in cases:
        rs = results[case]
        wall = statistics.median(r.wall_s for r in rs)
        tokens = statistics.median(r.num_tokens for r in rs)
        computed = statistics.median(r.prompt_tokens_computed for r in rs)
        cached = statistics.median(r.prompt_tokens_cached for r in rs)
        requests = 1 if case == "n=8" else NUM_CHOICES
        print(f"| {case} | {requests} | {wall:.2f} | {tokens / wall:.0f} | {computed:.0f} | {cached:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server; default: start loom-launcher")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--launcher-flag", action="append", default=[], help="extra flag for loom-launcher")
    args = parser.parse_args()
    if args.url:
        run(args.url, args.repeats, args.new_tokens, args.seed)
        return
    with launcher("--dtype", "bfloat16", *args.launcher_flag) as url:
        run(url, args.repeats, args.new_tokens, args.seed)


if __name__ == "__main__":
    main()
