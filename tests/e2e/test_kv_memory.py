"""KV memory end to end: preemption under a tiny budget, no leaks, a shared system prompt computed once."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest
from conftest import StartLauncher

pytestmark = pytest.mark.slow

MAX_NEW = 48


def scrape(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


async def generate(client: httpx.AsyncClient, prompt: str, max_new: int = MAX_NEW) -> list[int]:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new, "details": True}}
    response = await client.post("/generate", json=body)
    response.raise_for_status()
    return [t["id"] for t in response.json()["details"]["tokens"]]


def test_16_requests_in_a_budget_for_4_all_succeed_with_their_solo_outputs(start_launcher: StartLauncher) -> None:
    # 16-token blocks; ~20 prompt + 48 new tokens per request -> 5 blocks each; 20 blocks = 4 requests.
    # The host pool holds 6 blocks (float32 block = 737,280 bytes), so some preemptions must recompute.
    server = start_launcher("--dtype", "float32", "--max-batch-total-tokens", "320",
                            "--host-kv-cache-bytes", str(6 * 737_280), "--max-total-tokens", "320",
                            "--max-input-tokens", "256")
    prompts = [f"Story {i}: the {['red', 'blue', 'green', 'old'][i % 4]} fox number {i} went" for i in range(16)]

    async def run() -> tuple[list[list[int]], list[list[int]]]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=600) as client:
            solo = [await generate(client, p) for p in prompts]
            together = await asyncio.gather(*(generate(client, p) for p in prompts))
        return solo, list(together)

    solo, together = asyncio.run(run())
    assert together == solo
    metrics = scrape(server.base_url)
    assert metrics['loom_preemptions_total{kind="swap"}'] > 0
    assert metrics['loom_preemptions_total{kind="recompute"}'] > 0
    assert metrics["loom_swapped_bytes_total"] > 0


def test_200_random_requests_with_cancellations_leak_nothing(start_launcher: StartLauncher) -> None:
    server = start_launcher("--max-batch-total-tokens", "1024")
    rng = random.Random(0)

    async def one(client: httpx.AsyncClient, i: int) -> None:
        prompt = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "sea"]) for _ in range(rng.randint(1, 60)))
        body = {"inputs": prompt, "parameters": {"max_new_tokens": rng.randint(1, 24)}}
        if rng.random() < 0.3:  # a client that leaves mid-stream
            async with client.stream("POST", "/generate_stream", json=body) as response:
                async for _ in response.aiter_lines():
                    break
        else:
            (await client.post("/generate", json=body)).raise_for_status()

    async def run() -> None:
        limit = asyncio.Semaphore(24)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=600) as client:
            async def bounded(i: int) -> None:
                async with limit:
                    await one(client, i)
            await asyncio.gather(*(bounded(i) for i in range(200)))

    asyncio.run(run())
    deadline = time.monotonic() + 15
    while True:
        metrics = scrape(server.base_url)
        if metrics["loom_kv_blocks_used"] == 0 and metrics["loom_running_requests"] == 0:
            break
        assert time.monotonic() < deadline, f"blocks still in use when idle: {metrics['loom_kv_blocks_used']}"
        time.sleep(0.2)
    assert metrics["loom_kv_blocks_cached"] > 0
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200


def test_shared_1000_token_system_prompt_is_computed_once(start_launcher: StartLauncher) -> None:
    server = start_launcher("--max-total-tokens", "1400", "--max-input-tokens", "1300",
                            "--max-batch-total-tokens", "8192", "--max-batch-prefill-tokens", "2048")
    system = " ".join(f"Rule {i}: be kind to the user and answer in English." for i in range(68))
    url = server.base_url

    def ask(question: str) -> dict:
        body = {"model": "loom", "max_tokens": 2, "temperature": 0,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
        response.raise_for_status()
        return response.json()["usage"]

    before = scrape(url)["loom_prompt_tokens_computed_total"]

    async def all_at_once() -> list[dict]:
        return await asyncio.gather(*(asyncio.to_thread(ask, f"Question {i}?") for i in range(8)))

    usages = sorted(asyncio.run(all_at_once()), key=lambda u: u["prompt_tokens_details"]["cached_tokens"])
    computed = scrape(url)["loom_prompt_tokens_computed_total"] - before
    first, rest = usages[0], usages[1:]
    assert first["prompt_tokens"] > 1000
    shared = min(u["prompt_tokens_details"]["cached_tokens"] for u in rest)
    assert shared >= 1000 - 16  # the whole system prompt, up to its last partial block
    assert computed == sum(u["prompt_tokens"] - u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert computed < first["prompt_tokens"] + 7 * (first["prompt_tokens"] - shared) + 1
