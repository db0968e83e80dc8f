"""The router served by uvicorn on a free localhost port (a frontend and an engine core, fake shard),
exercised by the official `text_generation` and `openai` clients, and by clients that hang up."""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import openai
import pytest
import text_generation
from api_fakes import WORDS, FakeShardClient
from router_harness import served_router

from loom_proto.config import RouterConfig
from loom_router.core.engine import Engine
from loom_router.tokenizer import Tokenizer
from tests.net import free_port


@dataclass
class Served:
    url: str
    engine: Engine
    backend: FakeShardClient
    tokenizer: Tokenizer



@pytest.fixture
async def served(tokenizer: Tokenizer) -> AsyncIterator[Served]:
    backend = FakeShardClient(tokenizer.encode(WORDS), tokenizer.vocab_size, eos_id=tokenizer.eos_token_ids[0])
    config = RouterConfig(model_id="", shard_uds_paths=("fake.sock",), hostname="127.0.0.1", port=free_port(),
                          max_total_tokens=256, served_model_name="smol")
    async with served_router(config, backend, tokenizer) as (url, router, _):
        yield Served(url, router.engine, backend, tokenizer)


def expected_text(s: Served, prompt_ids: list[int], seed: int, count: int) -> str:
    return s.tokenizer.decode(s.backend.reference(prompt_ids, seed, count))


async def test_text_generation_client(served: Served) -> None:
    client = text_generation.AsyncClient(served.url)
    prompt_ids = served.tokenizer.encode("Hello")
    response = await client.generate("Hello", max_new_tokens=5, decoder_input_details=True, seed=3)
    assert response.generated_text == expected_text(served, prompt_ids, 3, 5)
    assert response.details.finish_reason.value == "length"
    assert [t.id for t in response.details.prefill] == prompt_ids
    streamed = [r async for r in client.generate_stream("Hello", max_new_tokens=5, seed=3)]
    assert [r.token.id for r in streamed] == [t.id for t in response.details.tokens]
    assert streamed[-1].generated_text == response.generated_text
    with pytest.raises(text_generation.errors.ValidationError):
        await client.generate("Hello", max_new_tokens=1000)


async def test_openai_client(served: Served) -> None:
    client = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
    models = await client.models.list()
    assert [m.id for m in models.data] == ["smol"]
    messages = [{"role": "user", "content": "Hi"}]
    chat_ids = served.tokenizer.encode(served.tokenizer.apply_chat_template(messages), add_special_tokens=False)
    chat = await client.chat.completions.create(model="smol", messages=messages, max_tokens=4, temperature=0,
                                                seed=7, logprobs=True, top_logprobs=1)
    assert chat.choices[0].message.content == expected_text(served, chat_ids, 7, 4)
    assert chat.choices[0].logprobs.content[0].top_logprobs[0].logprob == -1.0
    assert chat.usage.completion_tokens == 4 and chat.usage.prompt_tokens == len(chat_ids)
    stream = await client.chat.completions.create(model="smol", messages=messages, max_tokens=4, temperature=0,
                                                  seed=7, stream=True, stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].usage.total_tokens == chat.usage.total_tokens
    completion = await client.completions.create(model="smol", prompt="Hi", max_tokens=3, n=2, seed=10)
    prompt_ids = served.tokenizer.encode("Hi")
    assert [c.text for c in completion.choices] == [expected_text(served, prompt_ids, s, 3) for s in (10, 11)]
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model="smol", prompt="Hi", max_tokens=3, n=100)


async def wait_cancelled(engine: Engine, count: int) -> None:
    for _ in range(200):
        if engine.stats().requests_finished.get("cancelled", 0) >= count and not engine.stats().num_running:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not cancelled: {engine.stats()}")


async def test_stream_disconnect_cancels_the_request(served: Served) -> None:
    served.backend.step_delay_s = 0.01  # the request would run for 2 s
    async with httpx.AsyncClient(base_url=served.url) as client:
        async with client.stream("POST", "/generate_stream",
                                 json={"inputs": "x", "parameters": {"max_new_tokens": 200}}) as response:
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    break  # hang up after the first token
    await wait_cancelled(served.engine, 1)
    assert served.engine.stats().generated_tokens < 100


async def test_non_streaming_disconnect_cancels_the_request(served: Served) -> None:
    served.backend.step_delay_s = 0.01
    unhandled: list[dict] = []  # what asyncio reports, e.g. a future's exception never retrieved
    asyncio.get_running_loop().set_exception_handler(lambda _, context: unhandled.append(context))
    async with httpx.AsyncClient(base_url=served.url) as client:
        request = asyncio.create_task(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 200}))
        while served.engine.stats().generated_tokens < 3:
            await asyncio.sleep(0.01)
        request.cancel()  # closes the connection
        with pytest.raises(asyncio.CancelledError):
            await request
    await wait_cancelled(served.engine, 1)
    assert served.engine.stats().generated_tokens < 100
    gc.collect()  # an unretrieved exception is reported when its future is collected
    assert [c["message"] for c in unhandled] == []


@pytest.mark.parametrize("stream", [False, True])
async def test_disconnect_cancels_every_prompt_of_a_list(served: Served, stream: bool) -> None:
    served.backend.step_delay_s = 0.01
    body = {"prompt": ["x", "y z", "w"], "max_tokens": 200, "stream": stream}
    async with httpx.AsyncClient(base_url=served.url) as client:
        request = asyncio.create_task(client.post("/v1/completions", json=body))
        while served.engine.stats().generated_tokens < 9:
            await asyncio.sleep(0.01)
        request.cancel()  # closes the connection
        with pytest.raises(asyncio.CancelledError):
            await request
    await wait_cancelled(served.engine, 3)
    assert served.engine.stats().generated_tokens < 300


async def test_shutdown_lets_in_flight_streams_finish(tokenizer: Tokenizer) -> None:
    backend = FakeShardClient(tokenizer.encode(WORDS), tokenizer.vocab_size, eos_id=tokenizer.eos_token_ids[0])
    backend.step_delay_s = 0.01
    config = RouterConfig(model_id="", shard_uds_paths=("fake.sock",), hostname="127.0.0.1", port=free_port())
    events = []
    async with served_router(config, backend, tokenizer) as (url, router, server):
        async with httpx.AsyncClient(base_url=url) as client:
            async with client.stream("POST", "/generate_stream",
                                     json={"inputs": "x", "parameters": {"max_new_tokens": 30}}) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data:"):
                        events.append(line)
                        server.should_exit = True  # as SIGTERM does
        assert len(events) == 30 and json.loads(events[-1][5:])["generated_text"] is not None
        assert router.engine.stats().num_running == 0  # the stream's request ran to its end


async def test_head_is_answered_as_get_without_a_body(served: Served) -> None:
    async with httpx.AsyncClient(base_url=served.url, timeout=30) as client:
        for path in ("/health", "/info", "/v1/models", "/metrics"):
            head, get = await client.head(path), await client.get(path)
            assert head.status_code == get.status_code == 200, path
            assert head.content == b"" and head.headers.get("content-type") == get.headers.get("content-type"), path
        assert (await client.head("/generate")).status_code == 405
        metrics = (await client.get("/metrics")).text  # a HEAD is counted under its route, as the GET
        assert 'loom_http_requests_total{route="/info",status="200"} 2.0' in metrics, metrics
        assert 'route="unmatched",status="200"' not in metrics


@pytest.mark.parametrize("path, body", [
    ("/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": 2}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
])
async def test_a_json_body_sent_as_another_media_type_is_a_415(served: Served, path: str, body: dict) -> None:
    async with httpx.AsyncClient(base_url=served.url, timeout=30) as client:
        for media in ("application/x-www-form-urlencoded", "text/plain"):  # curl -d's, and a mistake's
            response = await client.post(path, content=json.dumps(body), headers={"content-type": media})
            assert response.status_code == 415 and "application/json" in response.text, response.text
        for media in ("application/json; charset=utf-8", "", None):  # no Content-Type: read as JSON
            headers = {"content-type": media} if media is not None else {}
            response = await client.post(path, content=json.dumps(body), headers=headers)
            assert response.status_code == 200, response.text
