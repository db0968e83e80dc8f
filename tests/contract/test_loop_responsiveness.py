"""Nothing a request sends can stall the event loop: while the largest allowed /tokenize and
/generate bodies are processed, /health keeps answering (over real HTTP, uvicorn, fake shard);
an input over the character cap is refused before any tokenizing.

The assertions count /health answers that complete while the big request is in flight (a
blocked loop answers none), not milliseconds; bench/bench_loop.py measures the latencies.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable

import httpx
import pytest
from api_fakes import WORDS, FakeShardClient
from router_harness import served_router

from loom_proto.config import RouterConfig
from loom_router.core.engine import Engine
from loom_router.frontend.http_common import INLINE_CHARS
from loom_router.tokenizer import Tokenizer
from tests.net import free_port

CONTEXT = 8192
# A text of many short tokens (the worst case for per-token work) with non-ASCII characters.
UNIT = "word é 日 "



@pytest.fixture
async def served(tokenizer: Tokenizer) -> AsyncIterator[tuple[str, Engine]]:
    backend = FakeShardClient(tokenizer.encode(WORDS), tokenizer.vocab_size, eos_id=tokenizer.eos_token_ids[0],
                              block_size=16, num_blocks=CONTEXT // 16 + 8, max_position_embeddings=CONTEXT)
    config = RouterConfig(model_id="", shard_uds_paths=("fake.sock",), hostname="127.0.0.1", port=free_port(),
                          max_batch_prefill_tokens=CONTEXT)
    async with served_router(config, backend, tokenizer) as (url, router, _):
        yield url, router.engine


async def health_answers_during(url: str, big: Awaitable[httpx.Response]) -> tuple[httpx.Response, int]:
    """Runs `big`, polling /health meanwhile; returns its response and how many /health answers
    arrived before it finished."""
    big_task = asyncio.ensure_future(big)
    answered = 0
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        while not big_task.done():
            health = client.get("/health")
            done, _ = await asyncio.wait({asyncio.ensure_future(health), big_task},
                                         return_when=asyncio.FIRST_COMPLETED)
            if big_task in done and len(done) == 1:
                break
            answered += 1
            await asyncio.sleep(0.02)
    return await big_task, answered


async def test_health_answers_while_the_largest_inputs_are_processed(served: tuple[str, Engine]) -> None:
    url, engine = served
    max_chars = 32 * engine.max_input_tokens  # the default --max-input-chars
    largest = (UNIT * (max_chars // len(UNIT) + 1))[:max_chars]
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        response, answered = await health_answers_during(url, client.post("/tokenize", json={"inputs": largest}))
        assert response.status_code == 200 and response.json()[-1]["stop"] <= len(largest)
        assert answered >= 1, "/health did not answer during the largest /tokenize"
        # The largest body /generate accepts tokenizes (off the loop) and is then refused for its tokens.
        response, answered = await health_answers_during(url, client.post("/generate", json={"inputs": largest}))
        assert response.status_code == 422 and "tokens" in response.json()["error"]
        # The longest prompt that fits, with prompt details (its token texts come off the loop too).
        body = {"inputs": largest, "parameters": {"max_new_tokens": 2, "details": True, "decoder_input_details": True,
                                                  "truncate": engine.max_input_tokens - 2}}
        response, answered = await health_answers_during(url, client.post("/generate", json=body))
        assert response.status_code == 200, response.text
        assert len(response.json()["details"]["prefill"]) == engine.max_input_tokens - 2
        response = await client.post("/tokenize", json={"inputs": largest + "x"})
        assert response.status_code == 422 and "characters" in response.json()["error"]


SLOW_S = 1.0  # a tokenization this slow (a huge input on a busy machine) must not hold the loop


# Longer than what the frontend tokenizes on the loop (a short prompt's thread hop would cost more
# than its tokenizing): made slow below, it stands for a long input.
LONG = "hello world " * (INLINE_CHARS // 12 + 1)


@pytest.mark.parametrize("path, body", [
    ("/tokenize", {"inputs": "hello world"}),
    ("/generate", {"inputs": LONG, "parameters": {"max_new_tokens": 2}}),
    ("/v1/completions", {"prompt": LONG, "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}], "max_tokens": 2}),
])
async def test_slow_tokenization_runs_off_the_loop(served: tuple[str, Engine], path: str, body: dict) -> None:
    await answers_while_slow(served, ("encode", "encode_with_offsets"), path, body)


async def test_a_chat_template_with_tools_renders_off_the_loop(served: tuple[str, Engine]) -> None:
    # Short messages, but the tools' JSON schemas (of any size) are rendered too.
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
    await answers_while_slow(served, ("apply_chat_template",), "/v1/chat/completions", body)


async def answers_while_slow(served: tuple[str, Engine], methods: tuple[str, ...], path: str, body: dict) -> None:
    """/health keeps answering while the request runs with the tokenizer's `methods` slowed."""
    url, engine = served
    tokenizer = engine.tokenizer

    def slow(fn):  # noqa: ANN001, ANN202 (blocks its thread as a long tokenization would)
        return lambda *args, **kwargs: (time.sleep(SLOW_S), fn(*args, **kwargs))[1]

    for name in methods:
        setattr(tokenizer, name, slow(getattr(tokenizer, name)))
    try:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            response, answered = await health_answers_during(url, client.post(path, json=body))
        assert response.status_code == 200, response.text
        assert answered >= 3, f"/health answered {answered} times in {SLOW_S} s of slowed {methods}"
    finally:
        for name in methods:
            delattr(tokenizer, name)
