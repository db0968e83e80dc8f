"""Constrained decoding and tool calling through the router's HTTP APIs (a frontend and an engine
core, fake shard).

The fake shard samples a hash-picked token among those its step's mask allows, so every
output below is a random walk through the grammar: it can only be valid if the router's
masks, matchers and finish logic are right.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import jsonschema
import pytest
from api_fakes import WORDS, FakeShardClient
from fake_shard import FakeShard
from router_harness import InProcessRouter, start_router
from test_api import invalid_status

from loom_proto.config import RouterConfig
from loom_proto.step import WarmupResult
from loom_router.core.engine import Engine
from loom_router.structured.grammar import COMPILE_THREADS, ConstraintSpec
from loom_router.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "code": {"type": "string", "pattern": "^[a-z]{3}$"},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 2},
        "inner": {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"],
                  "additionalProperties": False},
    },
    "required": ["color", "ok", "code", "tags", "inner"],
    "additionalProperties": False,
}
LONG_SCHEMA = {"type": "object", "properties": {"digits": {"type": "string", "pattern": "^[0-9]{50}$"},
                                              "color": {"enum": ["red", "green"]}},
               "required": ["digits", "color"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "city": {"enum": ["Paris", "Oslo"]}},
    "required": ["unit", "city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}
TOOL_PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
MESSAGES = [{"role": "user", "content": "hello"}]


@dataclass
class Harness:
    client: httpx.AsyncClient
    engine: Engine
    backend: FakeShardClient


class SwappingShardClient(FakeShardClient):
    """The fake shard with a host-RAM pool, so preemption swaps instead of recomputing."""

    def __init__(self, *args: object, num_host_blocks: int, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.shard = FakeShard(self.shard.block_size, len(self.shard.device), num_host_blocks)

    async def warmup(self, max_prefill_tokens: int, max_batch_total_tokens: int | None) -> WarmupResult:
        return WarmupResult(self.num_blocks, len(self.shard.host), self.block_size)


ROUTERS: dict[Engine, InProcessRouter] = {}  # by the engine `start` returned: what stop() stops


async def stop(engine: Engine) -> None:
    await ROUTERS.pop(engine).stop()


async def start(tokenizer: Tokenizer, num_blocks: int = 256,
                num_host_blocks: int = 0) -> tuple[Engine, httpx.AsyncClient, FakeShardClient]:
    kind = SwappingShardClient if num_host_blocks else FakeShardClient
    extra = {"num_host_blocks": num_host_blocks} if num_host_blocks else {}
    backend = kind(tokenizer.encode(WORDS), tokenizer.vocab_size, eos_id=tokenizer.eos_token_ids[0],
                   num_blocks=num_blocks, max_position_embeddings=512, **extra)
    config = RouterConfig(model_id="", shard_uds_paths=("fake.sock",), max_concurrent_requests=8,
                          max_total_tokens=512, max_n=4)
    router = await start_router(config, backend, tokenizer)
    ROUTERS[router.engine] = router
    return router.engine, router.http, backend


@pytest.fixture
async def harness(tokenizer: Tokenizer) -> AsyncIterator[Harness]:
    engine, client, backend = await start(tokenizer)
    async with client:
        yield Harness(client, engine, backend)
    await stop(engine)


async def chat(h: Harness, **body: object) -> dict:
    response = await h.client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 80, **body})
    assert response.status_code == 200, response.text
    return response.json()


async def test_json_schema_on_chat_validates_for_every_choice(harness: Harness) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    out = await chat(harness, response_format=fmt, n=4, seed=3, temperature=1.0)
    texts = [c["message"]["content"] for c in out["choices"]]
    for choice, text in zip(out["choices"], texts):
        assert choice["finish_reason"] == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
        assert list(json.loads(text)) == list(SCHEMA["properties"]), text  # the schema's order, as OpenAI's
    assert len(set(texts)) > 1  # each choice walks its own matcher
    plans = harness.backend.shard.plans
    assert any(plan.allowed_token_masks for plan in plans)


@pytest.mark.parametrize("body", [
    {"structured_outputs": {"regex": "[0-9]{3}-[a-c]{2}"}},
    {"guided_regex": "[0-9]{3}-[a-c]{2}"},
])
async def test_regex_on_completions(harness: Harness, body: dict) -> None:
    response = await harness.client.post("/v1/completions", json={"prompt": "id:", "max_tokens": 30, **body})
    choice = response.json()["choices"][0]
    assert re.fullmatch("[0-9]{3}-[a-c]{2}", choice["text"]) and choice["finish_reason"] == "stop"


async def test_choice_and_lark_grammar(harness: Harness) -> None:
    out = await chat(harness, structured_outputs={"choice": ["yes", "no", "maybe"]})
    assert out["choices"][0]["message"]["content"] in {"yes", "no", "maybe"}
    out = await chat(harness, structured_outputs={"grammar": 'start: "a" ("b" | "c")+ "!"'}, max_tokens=40)
    text = out["choices"][0]["message"]["content"]
    assert re.fullmatch("a[bc]+!", text) or out["choices"][0]["finish_reason"] == "length", text
    gbnf = 'root ::= "a" [bc]+ "!"'  # llama.cpp's grammar format, also taken
    for fields in ({"structured_outputs": {"grammar": gbnf}}, {"guided_grammar": gbnf}):
        out = await chat(harness, **fields, max_tokens=40)
        text = out["choices"][0]["message"]["content"]
        assert re.fullmatch("a[bc]+!", text) or out["choices"][0]["finish_reason"] == "length", text


async def test_tgi_grammar_json_and_regex(harness: Harness) -> None:
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"], "additionalProperties": False}
    for grammar, check in [({"type": "json", "value": schema}, lambda t: jsonschema.validate(json.loads(t), schema)),
                           ({"type": "regex", "value": "[xy]{4}"}, lambda t: re.fullmatch("[xy]{4}", t) or 1 / 0)]:
        response = await harness.client.post("/generate", json={
            "inputs": "go", "parameters": {"max_new_tokens": 30, "grammar": grammar, "details": True}})
        assert response.status_code == 200, response.text
        check(response.json()["generated_text"])
        assert response.json()["details"]["finish_reason"] == "eos_token"


async def test_length_cut_keeps_finish_reason_length(harness: Harness) -> None:
    out = await chat(harness, response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}}, max_tokens=3)
    assert out["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("body, reason", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}}, "json_schema"),
    ({"structured_outputs": {"regex": "[a-"}}, "unclosed character class"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "undefined_rule"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "only one"),
    ({"tool_choice": "required"}, "`tool_choice` needs `tools`"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in `tools`"),
])
async def test_bad_constraints_are_refused_and_the_server_stays_healthy(harness: Harness, body: dict,
                                                                         reason: str) -> None:
    steps_before = harness.backend.num_steps
    response = await harness.client.post("/v1/chat/completions", json={"messages": MESSAGES, **body})
    assert response.status_code == 400, response.text
    assert reason in response.json()["error"]["message"]
    assert harness.backend.num_steps == steps_before  # refused before any compute
    assert (await harness.client.get("/health")).status_code == 200
    bad_tgi = await harness.client.post("/generate", json={"inputs": "x", "parameters": {
        "grammar": {"type": "regex", "value": "(("}}})
    assert bad_tgi.status_code == 422 and "regex" in bad_tgi.json()["error"]
    out = await chat(harness, max_tokens=2)
    assert out["choices"][0]["finish_reason"] == "length"


# A regex llguidance compiles but cannot lex, a schema whose $ref loops: refused before any compute.
UNENFORCEABLE = [
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a{1000000}"}}, "cannot be enforced"),
    ("/generate", {"inputs": "x", "parameters": {"grammar": {"type": "regex", "value": "a{1000000}"}}},
     "cannot be enforced"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
        "schema": {"$ref": "#"}}}}, "allows no output"),
    ("/generate", {"inputs": "x", "parameters": {"grammar": {"type": "json", "value": {
        "$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}}}, "allows no output"),
    ("/v1/completions", {"prompt": "x", "guided_choice": [f"option {i}" for i in range(10_001)]}, "10000"),
]


@pytest.mark.parametrize("route, body, reason", UNENFORCEABLE)
async def test_a_constraint_that_cannot_be_enforced_is_refused_before_any_compute(
        harness: Harness, route: str, body: dict, reason: str) -> None:
    steps_before = harness.backend.num_steps
    response = await harness.client.post(route, json=body)
    assert response.status_code == invalid_status(route), response.text
    error = response.json()["error"]
    message = error["message"] if route.startswith("/v1/") else error
    assert reason in message and "<" not in message, message  # no parser state dump
    assert harness.backend.num_steps == steps_before


async def test_a_grammar_engine_panic_is_refused_without_its_text(harness: Harness) -> None:
    """Past ~65k symbols llguidance panics; its message and backtrace stay in the log."""
    rules = 66_000
    grammar = "start: " + " | ".join(f"r{i}" for i in range(rules)) + "\n" + "\n".join(
        f'r{i}: "x"' for i in range(rules))
    response = await harness.client.post("/v1/completions", json={"prompt": "x", "guided_grammar": grammar})
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert not any(word in message.lower() for word in ("panic", "backtrace", "assertion", "<unknown>")), message
    assert (await harness.client.get("/health")).status_code == 200


# Lexes 12 characters, then a regex the lexer cannot build: it fails only once generation gets there.
FAILS_LATER = 'start: c b\nc: /[a-z ]{12}/\nb: /a{1000000}/'
FAILS_LATER_SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^[a-z]{3}$"},
                                                     "b": {"type": "string", "pattern": "^a{1000000}$"}},
                      "required": ["a", "b"], "additionalProperties": False}


async def test_a_constraint_that_fails_while_generating_ends_in_an_error_never_a_success(harness: Harness) -> None:
    body = {"prompt": "x", "max_tokens": 40, "guided_grammar": FAILS_LATER}
    response = await harness.client.post("/v1/completions", json=body)
    assert response.status_code == 424, response.text
    assert "cannot be enforced" in response.json()["error"]["message"]
    async with harness.client.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
        events = [line async for line in stream.aiter_lines() if line.startswith("data:")]
    last = json.loads(events[-1][5:])
    assert "cannot be enforced" in last["error"]["message"], events[-3:]
    tgi = {"inputs": "x", "parameters": {"max_new_tokens": 40, "grammar": {"type": "json", "value": FAILS_LATER_SCHEMA}}}
    response = await harness.client.post("/generate", json=tgi)
    assert response.status_code == 424 and "cannot be enforced" in response.json()["error"], response.text
    async with harness.client.stream("POST", "/generate_stream", json=tgi) as stream:
        events = [json.loads(line[5:]) async for line in stream.aiter_lines() if line.startswith("data:")]
    assert stream.status_code == 200 and not any(event.get("generated_text") for event in events)
    assert events[-1]["error_type"] == "generation" and "cannot be enforced" in events[-1]["error"], events[-3:]
    assert harness.engine.stats().num_running == 0
    assert harness.engine.scheduler.block_manager.num_used_blocks == 0


async def test_compiling_is_bounded_in_time_and_leaves_the_tokenizing_threads_free(
        harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    compiler = harness.engine.grammars
    build = compiler._build

    def slow_build(spec: ConstraintSpec) -> object:
        time.sleep(1.5)  # holds its thread, as a huge grammar does
        return build(spec)

    monkeypatch.setattr(compiler, "_build", slow_build)
    compiler.compile_timeout_s = 0.5
    # More constraints than asyncio's default executor (which tokenizes) has threads.
    slow = [asyncio.create_task(harness.client.post("/v1/completions", json={
        "prompt": "x", "max_tokens": 2, "guided_regex": f"a{{{i + 1}}}"})) for i in range(8)]
    await asyncio.sleep(0.1)
    start = time.monotonic()
    tokenized = await harness.client.post("/tokenize", json={"inputs": "hello world"})
    generated = await harness.client.post("/generate", json={"inputs": "hello", "parameters": {"max_new_tokens": 2}})
    assert tokenized.status_code == 200 and generated.status_code == 200
    assert time.monotonic() - start < 1.0
    answers = await asyncio.gather(*slow)
    statuses = sorted(response.status_code for response in answers)
    # Those compiling when the time ran out are too complex (400 on OpenAI's routes); those still
    # waiting for a compile thread were turned away as load (429).
    assert statuses == [400] * COMPILE_THREADS + [429] * (8 - COMPILE_THREADS), [r.text for r in answers]
    assert any("did not compile within 0.5 s" in r.json()["error"]["message"] for r in answers)


@pytest.mark.parametrize("tool_choice, names", [
    ("required", {"get_weather", "get_time"}),
    ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
])
async def test_forced_tool_calls_validate(harness: Harness, tool_choice: object, names: set[str]) -> None:
    for seed in range(3):
        out = await chat(harness, tools=[WEATHER, TIME], tool_choice=tool_choice, parallel_tool_calls=False, seed=seed)
        choice = out["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), TOOL_PARAMS[call["function"]["name"]])


async def test_streamed_tool_calls_reassemble_to_the_same_call(harness: Harness) -> None:
    body = {"messages": MESSAGES, "max_tokens": 80, "tools": [WEATHER, TIME], "tool_choice": "required",
            "parallel_tool_calls": False, "seed": 5}
    whole = (await harness.client.post("/v1/chat/completions", json=body)).json()["choices"][0]
    response = await harness.client.post("/v1/chat/completions", json={**body, "stream": True})
    events = [json.loads(line[6:]) for line in response.text.split("\n\n") if line.startswith("data: {")]
    calls: dict[int, dict] = {}
    finish = None
    for event in events:
        choice = event["choices"][0]
        finish = choice["finish_reason"] or finish
        for delta in choice["delta"].get("tool_calls", []):
            call = calls.setdefault(delta["index"], {"name": "", "arguments": ""})
            call["name"] += delta.get("function", {}).get("name", "")
            call["arguments"] += delta.get("function", {}).get("arguments", "")
    expected = whole["message"]["tool_calls"][0]["function"]
    assert finish == "tool_calls" and calls == {0: {"name": expected["name"], "arguments": expected["arguments"]}}


@pytest.mark.parametrize("num_host_blocks, kind", [(0, "recompute"), (64, "swap")])
async def test_preempted_constrained_requests_resume_exactly(tokenizer: Tokenizer, num_host_blocks: int,
                                                             kind: str) -> None:
    """Under KV pressure requests are preempted (recomputed or swapped); their matchers must follow."""
    fmt = {"type": "json_schema", "json_schema": {"schema": LONG_SCHEMA}}

    async def run(client: httpx.AsyncClient, seed: int) -> str:
        response = await client.post("/v1/chat/completions", json={
            "messages": MESSAGES, "max_tokens": 90, "seed": seed, "response_format": fmt})
        return response.json()["choices"][0]["message"]["content"]

    engine, client, _ = await start(tokenizer)
    async with client:
        alone = [await run(client, seed) for seed in range(4)]
    await stop(engine)
    # ~36-token prompts + >= 55 tokens each (single-digit tokens): 40 blocks of 4 cannot hold all four
    engine, client, _ = await start(tokenizer, num_blocks=40, num_host_blocks=num_host_blocks)
    async with client:
        crowded = await asyncio.gather(*(run(client, seed) for seed in range(4)))
    assert getattr(engine.stats(), f"preemptions_{kind}") > 0
    await stop(engine)
    assert list(crowded) == alone
    for text in alone:
        jsonschema.validate(json.loads(text), LONG_SCHEMA)


async def test_a_prefix_cache_hit_gives_the_same_constrained_output(harness: Harness) -> None:
    fmt = {"type": "json_schema", "json_schema": {"schema": SCHEMA}}
    first = await chat(harness, response_format=fmt, seed=11)
    cached_before = harness.engine.stats().prompt_tokens_cached
    second = await chat(harness, response_format=fmt, seed=11)
    assert harness.engine.stats().prompt_tokens_cached > cached_before
    assert first["choices"][0]["message"] == second["choices"][0]["message"]
    jsonschema.validate(json.loads(first["choices"][0]["message"]["content"]), SCHEMA)


async def test_grammar_composes_with_choice_params_and_stop_sequences(harness: Harness) -> None:
    fmt = {"type": "json_schema", "json_schema": {"schema": SCHEMA}}
    out = await chat(harness, response_format=fmt, n=2, seed=2, choice_params=[{"temperature": 0.5}, {"seed": 99}])
    for choice in out["choices"]:
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    response = await harness.client.post("/v1/completions", json={
        "prompt": "x", "max_tokens": 30, "seed": 4, "structured_outputs": {"regex": "a{3}[0-9]{5}"}, "stop": ["aa"]})
    choice = response.json()["choices"][0]
    assert choice["text"] == "" and choice["finish_reason"] == "stop"  # the stop sequence cuts "aa"
