"""OpenAI's Responses API through the official `openai` client (responses.create, responses.stream,
retrieve, delete) against the in-process router (fake shard): input as a string or items,
instructions, tools and function calls, text.format json_schema, usage, stored responses and
previous_response_id, store false, streaming events; and the bounded store itself."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import jsonschema
import openai
import pytest
from api_fakes import FakeShardClient
from router_harness import start_router
from test_api import Harness, last_prompt, openai_client, router_config, script

from loom_router.response_store import ResponseStore
from loom_router.tokenizer import Tokenizer

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture
async def harness(backend: FakeShardClient, tokenizer: Tokenizer) -> AsyncIterator[Harness]:
    router = await start_router(router_config(max_total_tokens=512), backend, tokenizer)
    try:
        yield Harness(router.http, router.engine, backend, tokenizer, router)
    finally:
        await router.stop()


@pytest.fixture
def client(harness: Harness) -> openai.AsyncOpenAI:
    return openai_client(harness)


async def test_create_retrieve_delete(harness: Harness, client: openai.AsyncOpenAI) -> None:
    script(harness, "Paris is the capital.")
    out = await client.responses.create(model="default", input="Capital of France?", instructions="Be brief.")
    assert out.id.startswith("resp_") and out.status == "completed" and out.object == "response"
    assert out.output_text == "Paris is the capital." and [item.type for item in out.output] == ["message"]
    prompt = last_prompt(harness)
    assert "Be brief." in prompt and "Capital of France?" in prompt
    assert out.usage.input_tokens == len(harness.tokenizer.encode(prompt, add_special_tokens=False))
    assert out.usage.output_tokens == len(harness.backend.script) + 1
    assert (await client.responses.retrieve(out.id)).output_text == out.output_text
    await client.responses.delete(out.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(out.id)


async def test_previous_response_id_continues_and_store_false_keeps_nothing(
        harness: Harness, client: openai.AsyncOpenAI) -> None:
    script(harness, "Hi Ada.")
    first = await client.responses.create(model="default", input="My name is Ada.", instructions="First rules.")
    script(harness, "Your name is Ada.")
    second = await client.responses.create(model="default", input=[{"role": "user", "content": "My name?"}],
                                           previous_response_id=first.id, store=False)
    prompt = last_prompt(harness)
    assert "My name is Ada." in prompt and "Hi Ada." in prompt and "My name?" in prompt
    assert "First rules." not in prompt  # instructions are not carried over
    assert second.output_text == "Your name is Ada." and second.previous_response_id == first.id
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.create(model="default", input="x", previous_response_id="resp_nothing")


async def test_function_call_and_its_output(harness: Harness, client: openai.AsyncOpenAI) -> None:
    script(harness, CALL)
    out = await client.responses.create(model="default", input="Weather in Paris?", tools=[WEATHER])
    (call,) = out.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id
    script(harness, "It is sunny in Paris.")
    answer = await client.responses.create(
        model="default", previous_response_id=out.id, tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
    assert answer.output_text == "It is sunny in Paris."
    prompt = last_prompt(harness)
    assert "sunny, 21 C" in prompt and '"city": "Paris"' in prompt and "Weather in Paris?" in prompt


async def test_input_items_with_a_function_call_round_trip(harness: Harness, client: openai.AsyncOpenAI) -> None:
    script(harness, "Done.")
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "snow"}]
    out = await client.responses.create(model="default", input=items, tools=[WEATHER], store=False)
    assert out.output_text == "Done."
    assert "snow" in last_prompt(harness) and "Oslo" in last_prompt(harness)
    with pytest.raises(openai.BadRequestError, match="not supported"):
        await client.responses.create(model="default", input=[{"type": "computer_call", "id": "x"}])


async def test_a_forced_function_and_a_json_schema_format(client: openai.AsyncOpenAI) -> None:
    city = {**WEATHER, "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}}}
    out = await client.responses.create(model="default", input="Weather?", tools=[city],
                                        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60)
    (call,) = out.output
    assert call.type == "function_call" and set(json.loads(call.arguments)) <= {"city"}
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    out = await client.responses.create(model="default", input="JSON please", max_output_tokens=40,
                                        text={"format": {"type": "json_schema", "name": "r", "schema": schema,
                                                         "strict": True}})
    assert set(json.loads(out.output_text)) == {"ok"} and out.text.format.type == "json_schema"
    jsonschema.validate(json.loads(out.output_text), schema)


async def test_max_output_tokens_makes_an_incomplete_response(harness: Harness, client: openai.AsyncOpenAI) -> None:
    script(harness, " one two three four five six", then_eos=False)
    out = await client.responses.create(model="default", input="Count", max_output_tokens=3)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 3
    assert [(item.type, item.status) for item in out.output] == [("message", "incomplete")]
    assert out.output_text == harness.tokenizer.decode(harness.tokenizer.encode(" one two three")[:3])
    body = {"model": "default", "input": "Count", "max_output_tokens": 3, "stream": True}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=harness.router.app), base_url="http://loom") as http:
        events = [json.loads(line[6:]) for line in (await http.post("/v1/responses", json=body)).text.splitlines()
                  if line.startswith("data: ")]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(item["type"], item["status"]) for item in done] == [("message", "incomplete")]
    assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["output"] == done


@pytest.mark.parametrize("stream", [False, True])
async def test_usage_counts_the_prompt_tokens_served_from_the_prefix_cache(harness: Harness, stream: bool) -> None:
    script(harness, "Fine.")
    body = {"model": "default", "input": "Tell me about the weather in Paris today, please. " * 8, "stream": stream}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=harness.router.app), base_url="http://loom") as http:
        usages = []
        for _ in range(2):
            response = await http.post("/v1/responses", json=body)
            final = ([json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")][-1]
                     ["response"] if stream else response.json())
            usages.append(final["usage"])
    cached = [usage["input_tokens_details"]["cached_tokens"] for usage in usages]
    assert cached[0] == 0 and 0 < cached[1] <= usages[1]["input_tokens"]


async def test_streaming_text_events(harness: Harness, client: openai.AsyncOpenAI) -> None:
    script(harness, "Streaming is fun.")
    kinds, deltas = [], []
    async with client.responses.stream(model="default", input="Say something") as stream:
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = await stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_item.added" in kinds and "response.output_item.done" in kinds
    assert "".join(deltas) == final.output_text == "Streaming is fun."
    assert final.usage.output_tokens == len(harness.backend.script) + 1
    assert (await client.responses.retrieve(final.id)).output_text == final.output_text  # stored


async def test_streaming_a_function_call(harness: Harness, client: openai.AsyncOpenAI) -> None:
    script(harness, CALL)
    async with client.responses.stream(model="default", input="Weather?", tools=[WEATHER]) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    (call,) = final.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}


async def test_unknown_model_and_bad_input(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as error:
        await client.responses.create(model="gpt-5", input="Hi")
    assert error.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        await client.responses.create(model="default", input=[{"role": "wizard", "content": "Hi"}])


def test_the_store_drops_the_least_recently_used_past_its_bounds() -> None:
    store = ResponseStore(max_responses=2, max_bytes=10)
    store.put("a", b"1234")
    store.put("b", b"1234")
    assert store.get("a") == b"1234"  # "a" is now the most recently used
    store.put("c", b"12")
    assert store.get("b") is None and len(store) == 2
    store.put("d", b"123456")  # three records: "a" goes
    assert store.get("a") is None and store.get("c") == b"12" and store.num_bytes == 8
    store.put("e", b"12345")  # "c" was read after "d": "d" is the least recently used
    assert store.get("d") is None and store.num_bytes == 7
    store.put("f", b"123456789")  # "c" goes for the count, then "e" for the bytes
    assert store.get("c") is None and store.get("e") is None and store.num_bytes == 9
    assert not store.put("big", b"x" * 11) and store.get("big") is None
    assert store.delete("f") and not store.delete("f") and store.num_bytes == 0


async def test_an_openai_agents_agent_runs_a_tool_end_to_end(harness: Harness, client: openai.AsyncOpenAI) -> None:
    agents = pytest.importorskip("agents")  # openai-agents: its default model is the Responses API
    agents.set_tracing_disabled(True)
    asked: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        script(harness, "It is sunny in Paris.")  # the model's next answer, once it has the result
        return "sunny, 21 C"

    agent = agents.Agent(name="weather", instructions="Answer with the tool.", tools=[get_weather],
                         model=agents.OpenAIResponsesModel(model="default", openai_client=client))
    script(harness, CALL)
    result = await agents.Runner.run(agent, "Weather in Paris?")
    assert asked == ["Paris"] and result.final_output == "It is sunny in Paris."
    assert "sunny, 21 C" in last_prompt(harness)
    script(harness, CALL)  # the same, streamed
    streamed = agents.Runner.run_streamed(agent, "Weather in Paris?")
    async for _ in streamed.stream_events():
        pass
    assert asked == ["Paris", "Paris"] and streamed.final_output == "It is sunny in Paris."


async def test_a_reasoning_models_thinking_is_a_reasoning_item(tokenizer: Tokenizer) -> None:
    from test_reasoning_tools import THINKING, _harness, _with_template

    async for h in _harness(_with_template(tokenizer, THINKING), "<think>It is Oslo.</think>Snow."):
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=h.router.app), base_url="http://loom/v1")
        client = openai.AsyncOpenAI(base_url="http://loom/v1", api_key="-", http_client=http, max_retries=0)
        out = await client.responses.create(model="default", input="Weather in Oslo?")
        assert [item.type for item in out.output] == ["reasoning", "message"]
        assert out.output[0].content[0].text == "It is Oslo." and out.output_text == "Snow."
        async with client.responses.stream(model="default", input="Weather in Oslo?") as stream:
            kinds = [event.type async for event in stream]
            final = await stream.get_final_response()
        assert "response.reasoning_text.delta" in kinds
        assert [item.type for item in final.output] == ["reasoning", "message"] and final.output_text == "Snow."
