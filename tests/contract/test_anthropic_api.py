"""Anthropic's Messages API through the official `anthropic` client against the in-process router
(fake shard): system and content blocks, stop sequences, tools with tool_use / tool_result,
streaming with Anthropic's events, count_tokens and Anthropic's error shapes.

The fake shard writes a scripted answer (`backend.script`, then EOS at `backend.eos_at`), since
Anthropic's API has no seed."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anthropic
import pytest
from api_fakes import FakeShardClient
from router_harness import served_router
from test_api import MAX_TOTAL_TOKENS, Harness, last_prompt, router_config, script

from loom_router.tokenizer import Tokenizer
from tests.net import free_port

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture
async def harness(backend: FakeShardClient, tokenizer: Tokenizer) -> AsyncIterator[Harness]:
    config = router_config(max_total_tokens=256, hostname="127.0.0.1", port=free_port())
    async with served_router(config, backend, tokenizer) as (url, router, _):
        harness = Harness(router.http, router.engine, backend, tokenizer, router)
        harness.url = url  # type: ignore[attr-defined]
        yield harness


@pytest.fixture
async def client(harness: Harness) -> AsyncIterator[anthropic.AsyncAnthropic]:
    # over a real socket: the client brings its own HTTP library
    client = anthropic.AsyncAnthropic(base_url=harness.url, api_key="-", max_retries=0)  # type: ignore[attr-defined]
    yield client
    await client.close()


async def test_a_message_with_system_and_content_blocks(harness: Harness, client: anthropic.AsyncAnthropic) -> None:
    script(harness, "Bonjour, Paris!")
    messages = [{"role": "user", "content": [{"type": "text", "text": "Say hello "},
                                             {"type": "text", "text": "in French."}]}]
    out = await client.messages.create(model="default", max_tokens=20, system="You are terse.", messages=messages)
    assert out.type == "message" and out.role == "assistant" and out.id.startswith("msg_")
    assert [b.type for b in out.content] == ["text"] and out.content[0].text == "Bonjour, Paris!"
    assert out.stop_reason == "end_turn" and out.stop_sequence is None
    prompt = last_prompt(harness)
    assert "You are terse." in prompt and "Say hello in French." in prompt
    counted = await client.messages.count_tokens(model="default", system="You are terse.", messages=messages)
    assert out.usage.input_tokens == counted.input_tokens == len(harness.tokenizer.encode(prompt,
                                                                                          add_special_tokens=False))
    assert out.usage.output_tokens == len(harness.backend.script) + 1  # and the EOS


async def test_stop_sequences_and_max_tokens(harness: Harness, client: anthropic.AsyncAnthropic) -> None:
    script(harness, " one two three four five", then_eos=False)
    ask = [{"role": "user", "content": "Count."}]
    out = await client.messages.create(model="default", max_tokens=20, messages=ask, stop_sequences=["three", "zz"])
    assert out.content[0].text == " one two " and out.stop_reason == "stop_sequence"
    assert out.stop_sequence == "three"
    out = await client.messages.create(model="default", max_tokens=2, messages=ask)
    assert out.stop_reason == "max_tokens" and out.usage.output_tokens == 2


async def test_a_final_assistant_message_is_continued(harness: Harness, client: anthropic.AsyncAnthropic) -> None:
    script(harness, 'red"}')
    ask = {"role": "user", "content": "Name a primary color."}
    out = await client.messages.create(model="default", max_tokens=10,
                                       messages=[ask, {"role": "assistant", "content": '{"color": "'}])
    assert out.content[0].text == 'red"}'  # the answer goes on from the prefill, without repeating it
    opened = harness.tokenizer.apply_chat_template([{"role": "user", "content": "Name a primary color."}])
    assert last_prompt(harness) == opened + '{"color": "'
    counted = await client.messages.count_tokens(model="default",
                                                 messages=[ask, {"role": "assistant", "content": '{"color": "'}])
    assert counted.input_tokens == out.usage.input_tokens
    with pytest.raises(anthropic.BadRequestError, match="trailing whitespace"):
        await client.messages.create(model="default", max_tokens=10,
                                     messages=[ask, {"role": "assistant", "content": "The color is "}])


async def test_tool_use_and_tool_result_round_trip(harness: Harness, client: anthropic.AsyncAnthropic) -> None:
    script(harness, CALL)
    ask = {"role": "user", "content": "Weather in Paris?"}
    out = await client.messages.create(model="default", max_tokens=60, messages=[ask], tools=[WEATHER])
    assert out.stop_reason == "tool_use"
    (use,) = out.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}
    assert use.id.startswith("toolu_")
    script(harness, "It is sunny.")
    turn = [ask, {"role": "assistant", "content": out.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"}]}]
    out = await client.messages.create(model="default", max_tokens=20, messages=turn, tools=[WEATHER])
    assert out.content[0].text == "It is sunny." and out.stop_reason == "end_turn"
    prompt = last_prompt(harness)
    assert "sunny, 21 C" in prompt and '"city": "Paris"' in prompt and "get_weather" in prompt
    orphan = [ask, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "?"}]}]
    with pytest.raises(anthropic.BadRequestError, match="answer no tool_use block"):
        await client.messages.create(model="default", max_tokens=5, messages=orphan, tools=[WEATHER])
    unanswered = [ask, turn[1], {"role": "user", "content": "and?"}]  # the tool_use, never answered
    with pytest.raises(anthropic.BadRequestError, match="have no tool_result"):
        await client.messages.create(model="default", max_tokens=5, messages=unanswered, tools=[WEATHER])


async def test_a_forced_tool_is_one_tool_use(harness: Harness, client: anthropic.AsyncAnthropic) -> None:
    city = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}
    out = await client.messages.create(model="default", max_tokens=60, tools=[{**WEATHER, "input_schema": city}],
                                       messages=[{"role": "user", "content": "Weather?"}],
                                       tool_choice={"type": "tool", "name": "get_weather"})
    assert out.stop_reason == "tool_use" and [b.type for b in out.content] == ["tool_use"]
    assert set(out.content[0].input) == {"city"}


@pytest.mark.parametrize("max_tokens", [1, 3, 5, 9])
async def test_a_forced_tool_cut_off_is_a_partial_tool_use_or_nothing(client: anthropic.AsyncAnthropic,
                                                                      max_tokens: int) -> None:
    body = dict(model="default", max_tokens=max_tokens, tools=[WEATHER], tool_choice={"type": "any"},
                messages=[{"role": "user", "content": "Weather?"}])
    out = await client.messages.create(**body)
    assert out.stop_reason == "max_tokens"
    assert [(b.type, b.name) for b in out.content] in ([], [("tool_use", "get_weather")])  # no text: no markup
    async with client.messages.stream(**body) as stream:
        final = await stream.get_final_message()
    assert [(b.type, b.name) for b in final.content] == [(b.type, b.name) for b in out.content]


async def test_streaming_text_with_anthropics_events(harness: Harness, client: anthropic.AsyncAnthropic) -> None:
    script(harness, "Hello there, friend.")
    async with client.messages.stream(model="default", max_tokens=20,
                                      messages=[{"role": "user", "content": "Hi"}]) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(kinds)
    assert final.content[0].text == "Hello there, friend." and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == len(harness.backend.script) + 1
    raw = await harness.client.post("/v1/messages", json={"model": "default", "max_tokens": 5, "stream": True,
                                                         "messages": [{"role": "user", "content": "Hi"}]})
    names = [line.removeprefix("event: ") for line in raw.text.splitlines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"]  # as Anthropic's API opens a stream (the SDK skips pings)


async def test_streaming_a_tool_use(harness: Harness, client: anthropic.AsyncAnthropic) -> None:
    script(harness, "Let me check. " + CALL)
    async with client.messages.stream(model="default", max_tokens=60, tools=[WEATHER],
                                      messages=[{"role": "user", "content": "Weather in Paris?"}]) as stream:
        final = await stream.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[0].text.strip() == "Let me check." and final.content[1].input == {"city": "Paris"}
    assert final.stop_reason == "tool_use"


async def test_errors_in_anthropics_shape(harness: Harness, client: anthropic.AsyncAnthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as error:
        await client.messages.create(model="claude-x", max_tokens=5, messages=[{"role": "user", "content": "Hi"}])
    assert error.value.body["type"] == "error" and error.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as error:
        await client.messages.create(model="default", max_tokens=5, messages=[])
    assert error.value.body["error"]["type"] == "invalid_request_error"
    long = [{"role": "user", "content": "word " * MAX_TOTAL_TOKENS * 4}]
    with pytest.raises(anthropic.BadRequestError, match="context"):
        await client.messages.create(model="default", max_tokens=5, messages=long)
    counted = await client.messages.count_tokens(model="default", messages=long)  # counting has no limit
    assert counted.input_tokens > MAX_TOTAL_TOKENS * 4
    response = await harness.client.post("/v1/messages", json={"model": "default", "messages": []})
    assert response.status_code == 400 and "max_tokens" in response.json()["error"]["message"]
    hi = [{"role": "user", "content": "Hi"}]
    for stream in (False, True):  # a count past what the shard protocol carries is the client's error
        response = await harness.client.post("/v1/messages", json={"model": "default", "max_tokens": 5, "messages": hi,
                                                                   "top_k": 10**19, "stream": stream})
        assert response.status_code == 400 and "top_k" in response.json()["error"]["message"]
    wrong_method = await harness.client.get("/v1/messages")  # the client's mistake, not the server's api_error
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["type"] == "invalid_request_error"


async def test_a_reasoning_models_thinking_is_a_thinking_block(backend: FakeShardClient, tokenizer: Tokenizer) -> None:
    from test_reasoning_tools import THINKING, _with_template

    thinking = _with_template(tokenizer, THINKING)
    backend.script = tokenizer.encode("<think>It is Oslo.</think>Snow.", add_special_tokens=False)
    backend.eos_at = len(backend.script)
    config = router_config(max_total_tokens=256, hostname="127.0.0.1", port=free_port())
    async with served_router(config, backend, thinking) as (url, _, _):
        client = anthropic.AsyncAnthropic(base_url=url, api_key="-", max_retries=0)
        ask = [{"role": "user", "content": "Weather in Oslo?"}]
        out = await client.messages.create(model="default", max_tokens=30, messages=ask)
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in out.content] == [
            ("thinking", "It is Oslo."), ("text", "Snow.")]
        async with client.messages.stream(model="default", max_tokens=30, messages=ask) as stream:
            final = await stream.get_final_message()
        assert [b.type for b in final.content] == ["thinking", "text"] and final.content[1].text == "Snow."
        await client.close()
