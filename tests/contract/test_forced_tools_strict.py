"""Forced tool calls (one call for a named function, `required` ending after a call, a call cut
off by max_tokens returned as a partial call), strict schemas (only the listed keys) and TGI's
response_format on chat, through the official `openai` client against the in-process router.

The fake shard walks the grammar at random (tests/contract/test_structured.py), so an output
can only hold these properties if the grammar the router compiled holds them.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator

import httpx
import jsonschema
import openai
import pytest
from test_structured import MESSAGES, TIME, TOOL_PARAMS, WEATHER, Harness, start, stop

from loom_router.frontend.tools import NamedToolChoice, ToolFields, plan_tools
from loom_router.structured.spec import strict_schema
from loom_router.tokenizer import Tokenizer

# Tool parameters and a schema that list their keys without closing their objects.
OPEN_WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}}}
OPEN_SCHEMA = {"type": "object", "properties": {"a": {"type": "boolean"},
                                                "inner": {"type": "object", "properties": {"n": {"enum": [1, 2]}}}},
               "required": ["a"]}


@pytest.fixture
async def harness(tokenizer: Tokenizer) -> AsyncIterator[Harness]:
    engine, client, backend = await start(tokenizer)
    async with client:
        yield Harness(client, engine, backend)
    await stop(engine)


@pytest.fixture
def client(harness: Harness) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://loom/v1", api_key="-", max_retries=0,
                              http_client=httpx.AsyncClient(transport=harness.client._transport,
                                                            base_url="http://loom/v1"))


def test_a_named_function_is_one_call_and_required_goes_on_only_when_asked() -> None:
    def start_rule(**fields: object) -> str:
        plan = plan_tools(ToolFields.model_validate({"tools": [WEATHER, TIME], **fields}))
        assert plan.spec is not None
        return plan.spec.source.splitlines()[0]

    named = {"type": "function", "function": {"name": "get_time"}}
    assert start_rule(tool_choice=named) == "start: call"
    assert start_rule(tool_choice=named, parallel_tool_calls=True) == "start: call"
    assert start_rule(tool_choice="required") == "start: call"
    assert start_rule(tool_choice="required", parallel_tool_calls=True) == 'start: call ("\\n" call)*'
    assert isinstance(ToolFields.model_validate({"tool_choice": named}).tool_choice, NamedToolChoice)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
async def test_forced_choices_end_with_exactly_one_call(client: openai.AsyncOpenAI, tool_choice: object) -> None:
    for seed in range(4):
        out = await client.chat.completions.create(model="default", messages=MESSAGES, tools=[WEATHER, TIME],
                                                   tool_choice=tool_choice, seed=seed, max_tokens=80)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), TOOL_PARAMS[call.function.name])


# What pydantic writes for nested models: $defs and $ref (two tools' `Place`s differ: their
# definitions must not meet), one recursive; and a function of no parameters.
PLACE_TOOLS = {
    "book": {"$defs": {"Place": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                                 "required": ["city"]}},
             "type": "object", "properties": {"to": {"$ref": "#/$defs/Place"}}, "required": ["to"]},
    "find": {"definitions": {"Place": {"type": "object", "properties": {"zip": {"enum": ["75001", "0150"]},
                                                                        "near": {"$ref": "#"}},
                                       "required": ["zip"]}},
             "type": "object", "properties": {"at": {"$ref": "#/definitions/Place"}}, "required": ["at"]},
}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "find"}}])
async def test_forced_calls_follow_schemas_with_definitions_and_references(client: openai.AsyncOpenAI,
                                                                          tool_choice: object) -> None:
    tools = [{"type": "function", "function": {"name": name, "parameters": params}}
             for name, params in PLACE_TOOLS.items()]
    names = []
    for seed in range(6):
        out = await client.chat.completions.create(model="default", messages=MESSAGES, tools=tools, seed=seed,
                                                   tool_choice=tool_choice, max_tokens=200)
        choice = out.choices[0]
        if choice.finish_reason != "tool_calls":  # a recursive `near` may run past max_tokens
            continue
        (call,) = choice.message.tool_calls
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, PLACE_TOOLS[call.function.name])
        assert set(arguments) == set(PLACE_TOOLS[call.function.name]["properties"])  # strict: listed keys only
        names.append(call.function.name)
    assert len(names) >= 3, names


async def test_a_forced_function_without_parameters_takes_no_arguments(client: openai.AsyncOpenAI) -> None:
    tools = [{"type": "function", "function": {"name": "ping"}}]
    for seed in range(3):
        out = await client.chat.completions.create(model="default", messages=MESSAGES, tools=tools, seed=seed,
                                                   tool_choice="required", max_tokens=40)
        (call,) = out.choices[0].message.tool_calls
        assert call.function.name == "ping" and json.loads(call.function.arguments) == {}


async def test_required_with_parallel_calls_may_end_after_any_call(client: openai.AsyncOpenAI) -> None:
    counts = set()
    for seed in range(6):
        out = await client.chat.completions.create(model="default", messages=MESSAGES, tools=[WEATHER, TIME],
                                                   tool_choice="required", parallel_tool_calls=True, seed=seed,
                                                   max_tokens=200)
        choice = out.choices[0]
        if choice.finish_reason == "tool_calls":
            counts.add(len(choice.message.tool_calls))
    assert 1 in counts  # it ended after its first call at least once (the grammar let it)


@pytest.mark.parametrize("max_tokens", [1, 3, 5, 9, 14])
async def test_a_forced_call_cut_off_by_max_tokens_is_a_partial_call(client: openai.AsyncOpenAI,
                                                                    max_tokens: int) -> None:
    """Cut inside the call's marker, before its name is complete or after: no markup in the
    content, and a call only once it names its function."""
    body = dict(model="default", messages=MESSAGES, tools=[WEATHER], seed=1, max_tokens=max_tokens,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    out = await client.chat.completions.create(**body)
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    calls = choice.message.tool_calls or []
    assert [call.function.name for call in calls] in ([], ["get_weather"])
    assert all("<tool_call>" not in call.function.arguments for call in calls)
    stream = await client.chat.completions.create(**body, stream=True)
    content, names, arguments, finish = "", [], "", None
    async for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        names += [c.function.name for c in delta.tool_calls or [] if c.function.name is not None]
        arguments += "".join(c.function.arguments or "" for c in delta.tool_calls or [])
        finish = chunk.choices[0].finish_reason or finish
    assert content == "" and names == [call.function.name for call in calls] and finish == "length"
    assert arguments == "".join(call.function.arguments for call in calls)


@pytest.mark.parametrize(("written", "content", "calls"), [
    ('Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', "Sure.",
     [("get_weather", '{"city": "Par')]),
    ('Sure. <tool_call>\n{"name": "get_wea', "Sure.", []),  # its name not complete: no call
    ("Sure. <tool_", "Sure.", []),  # the marker itself cut: not content either
])
async def test_a_call_the_model_wrote_cut_off_is_a_partial_call_not_content(
        harness: Harness, client: openai.AsyncOpenAI, tokenizer: Tokenizer, written: str, content: str,
        calls: list[tuple[str, str]]) -> None:
    harness.backend.script = tokenizer.encode(written, add_special_tokens=False)
    body = dict(model="default", messages=MESSAGES, tools=[WEATHER], max_tokens=len(harness.backend.script))
    out = await client.chat.completions.create(**body)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "length" and message.content == content
    assert [(call.function.name, call.function.arguments) for call in message.tool_calls or []] == calls
    streamed = ""
    async for chunk in await client.chat.completions.create(**body, stream=True):
        streamed += chunk.choices[0].delta.content or ""
    assert streamed.strip() == content


async def test_tool_arguments_admit_only_their_listed_keys(client: openai.AsyncOpenAI) -> None:
    for seed in range(4):
        out = await client.chat.completions.create(model="default", messages=MESSAGES, tools=[OPEN_WEATHER],
                                                   tool_choice="required", seed=seed, max_tokens=80)
        (call,) = out.choices[0].message.tool_calls
        assert set(json.loads(call.function.arguments)) == {"city"}


async def test_a_strict_json_schema_admits_only_its_listed_keys(client: openai.AsyncOpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": OPEN_SCHEMA, "strict": True}}
    for seed in range(4):
        out = await client.chat.completions.create(model="default", messages=MESSAGES, response_format=fmt,
                                                   seed=seed, max_tokens=80)
        value = json.loads(out.choices[0].message.content)
        assert set(value) <= {"a", "inner"} and set(value.get("inner", {})) <= {"n"}


def test_strict_schema_closes_objects_that_list_properties() -> None:
    closed = strict_schema({"type": "object", "properties": {"x": {"type": "object", "properties": {}}},
                            "$defs": {"d": {"properties": {"y": {}}}},
                            "items": {"anyOf": [{"type": "object", "properties": {"z": {}}}]}})
    assert closed["additionalProperties"] is False
    assert closed["properties"]["x"]["additionalProperties"] is False
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert closed["items"]["anyOf"][0]["additionalProperties"] is False
    free = {"type": "object"}  # lists no keys: any object, as the schema says
    assert strict_schema(free) == free
    said = {"type": "object", "properties": {"x": {}}, "additionalProperties": {"type": "integer"}}
    assert strict_schema(said) == said


async def test_tgi_response_format_json_and_regex_on_chat(client: openai.AsyncOpenAI) -> None:
    schema = TOOL_PARAMS["get_time"]
    out = await client.chat.completions.create(model="default", messages=MESSAGES, seed=2, max_tokens=40,
                                               response_format={"type": "json", "value": schema})  # type: ignore[arg-type]
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    out = await client.chat.completions.create(model="default", messages=MESSAGES, seed=2, max_tokens=40,
                                               response_format={"type": "regex", "value": "[0-9]{3}-[a-c]{2}"})  # type: ignore[arg-type]
    assert re.fullmatch("[0-9]{3}-[a-c]{2}", out.choices[0].message.content)
    with pytest.raises(openai.BadRequestError, match="regex string"):
        await client.chat.completions.create(model="default", messages=MESSAGES,
                                             response_format={"type": "regex", "value": {"a": 1}})  # type: ignore[arg-type]
