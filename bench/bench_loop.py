"""/health latency while the router processes the largest inputs it accepts.

Starts the real launcher with the embedded model, then for each big request polls /health
from a second connection until the big one ends: a request that stalls the router's event
loop shows up as one /health call lasting as long as the stall.

    python bench/bench_loop.py
"""

from __future__ import annotations

import asyncio
import statistics
import time

import httpx
from common import launcher, machine

UNIT = "word é 日 "  # many short tokens, non-ASCII: the worst case for per-token work
CHARS_PER_INPUT_TOKEN = 32  # the default --max-input-chars is this x max-input-tokens
PREFILL_TOKENS = 1024  # the case the model computes: a full 8k prefill takes minutes on 2 busy cores


async def during(url: str, path: str, body: dict) -> tuple[int, float, list[float]]:
    """(status, seconds the big request took, /health latencies meanwhile)."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as big_client, \
            httpx.AsyncClient(base_url=url, timeout=300) as probe:
        started = time.perf_counter()
        big = asyncio.ensure_future(big_client.post(path, json=body))
        latencies = []
        while not big.done():
            t0 = time.perf_counter()
            await probe.get("/health")
            latencies.append(time.perf_counter() - t0)
            await asyncio.sleep(0.01)
        response = await big
        return response.status_code, time.perf_counter() - started, latencies


async def run(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        info = (await client.get("/info")).json()
        max_chars = CHARS_PER_INPUT_TOKEN * info["max_input_tokens"]
        largest = (UNIT * (max_chars // len(UNIT) + 1))[:max_chars]
        t0 = time.perf_counter()
        over = await client.post("/generate", json={"inputs": largest + "x"})
        refused_ms = (time.perf_counter() - t0) * 1e3
    cases = [
        ("/tokenize", {"inputs": largest}),
        ("/generate", {"inputs": largest, "parameters": {"max_new_tokens": 1}}),
        ("/generate", {"inputs": largest, "parameters": {"max_new_tokens": 1, "details": True,
                                                          "decoder_input_details": True,
                                                          "truncate": PREFILL_TOKENS}}),
    ]
    print(f"machine: {machine()}; input {len(largest)} characters (the cap); over the cap: "
          f"{over.status_code} in {refused_ms:.0f} ms")
    print("| request | status | request s | /health calls | /health p50 ms | /health max ms |")
    print("|---|---|---|---|---|---|")
    for path, body in cases:
        status, seconds, lat = await during(url, path, body)
        truncated = "truncate" in body.get("parameters", {})
        label = path + (f" (truncated to {PREFILL_TOKENS} tokens, prefilled, prompt details)" if truncated else "")
        print(f"| {label} | {status} | {seconds:.2f} | {len(lat)} | {statistics.median(lat) * 1e3:.1f} | "
              f"{max(lat) * 1e3:.1f} |", flush=True)


def main() -> None:
    with launcher() as url:
        asyncio.run(run(url))


if __name__ == "__main__":
    main()
