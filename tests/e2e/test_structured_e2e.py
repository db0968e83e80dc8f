"""Structured output and tool calling end to end: the real launcher and model, the official
`openai` and `text_generation` clients. Schemas are tiny and max_tokens small: 2 CPU cores."""

from __future__ import annotations

import json
import re
from enum import Enum

import httpx
import jsonschema
import openai
import pytest
from conftest import Launcher
from pydantic import BaseModel
from text_generation import Client
from text_generation.types import Grammar, GrammarType

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "Describe a person as JSON."}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "mood": {"enum": ["happy", "sad"]},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2},
        "home": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
                 "additionalProperties": False},
    },
    "required": ["name", "mood", "pets", "home"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
TOOL_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_json_schema_at_temperature_one_validates(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in range(3):
        out = client.chat.completions.create(model="loom", messages=ASK, max_tokens=60, temperature=1.0,
                                             seed=seed, response_format=fmt)
        assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
        jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)


def test_n4_with_a_schema_gives_four_valid_different_outputs(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    out = client.chat.completions.create(model="loom", messages=ASK, max_tokens=60, temperature=1.0, seed=7,
                                         n=4, response_format=fmt)
    texts = [c.message.content for c in out.choices]
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(texts)) == 4, texts


class Mood(str, Enum):  # noqa: UP042 - as a user of pydantic writes it
    happy = "happy"
    sad = "sad"


class Answer(BaseModel):
    mood: Mood
    sunny: bool


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    out = client.beta.chat.completions.parse(model="loom", messages=ASK, max_tokens=30, temperature=0,
                                             response_format=Answer)
    assert isinstance(out.choices[0].message.parsed, Answer)


def test_regex_constraint(client: openai.OpenAI) -> None:
    out = client.completions.create(model="loom", prompt="A code:", max_tokens=12, temperature=1.0, seed=1,
                                    extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}})
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", out.choices[0].text)


@pytest.mark.parametrize("tool_choice, names", [
    ("required", {"get_weather", "get_time"}),
    ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
])
def test_forced_tool_calls_validate(client: openai.OpenAI, tool_choice: object, names: set[str]) -> None:
    out = client.chat.completions.create(model="loom", messages=TOOL_ASK, max_tokens=50, temperature=0,
                                         tools=[WEATHER, TIME], tool_choice=tool_choice, parallel_tool_calls=False)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name in names
    jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_streamed_tool_calls_reassemble(client: openai.OpenAI) -> None:
    kwargs = dict(model="loom", messages=TOOL_ASK, max_tokens=50, temperature=0, tools=[WEATHER],
                  tool_choice="required", parallel_tool_calls=False)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    name, arguments, finish = "", "", None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            name += delta.function.name or ""
            arguments += delta.function.arguments or ""
    assert finish == "tool_calls"
    assert (name, json.loads(arguments)) == (whole.function.name, json.loads(whole.function.arguments))


def test_text_generation_client_grammar(server: Launcher) -> None:
    tgi = Client(server.base_url, timeout=120)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    out = tgi.generate("Answer in JSON:", max_new_tokens=20, grammar=Grammar(type=GrammarType.Json, value=schema))
    jsonschema.validate(json.loads(out.generated_text), schema)
    out = tgi.generate("Year:", max_new_tokens=8, do_sample=True, seed=3,
                       grammar=Grammar(type=GrammarType.Regex, value="(19|20)[0-9]{2}"))
    assert re.fullmatch("(19|20)[0-9]{2}", out.generated_text)


def test_bad_schema_is_400_and_the_server_stays_healthy(server: Launcher, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="regex"):
        client.completions.create(model="loom", prompt="x", max_tokens=4,
                                  extra_body={"structured_outputs": {"regex": "[0-"}})
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": "a"}}}
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="loom", messages=ASK, max_tokens=4, response_format=bad)
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    assert client.completions.create(model="loom", prompt="Hi", max_tokens=2).choices[0].text
