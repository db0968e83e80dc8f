"""The router's HTTP API (TGI and OpenAI routes) through a frontend and an engine core driving a fake shard."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import openai
import pytest
from api_fakes import WORDS, FakeShardClient
from router_harness import InProcessRouter, start_router

from loom_proto.config import RouterConfig
from loom_router.core.engine import Engine
from loom_router.tokenizer import Tokenizer

MAX_TOTAL_TOKENS = 64


@dataclass
class Harness:
    client: httpx.AsyncClient
    engine: Engine  # the engine core's
    backend: FakeShardClient
    tokenizer: Tokenizer
    router: InProcessRouter


def script(h: Harness, text: str, then_eos: bool = True) -> None:
    """Every sequence the fake shard runs writes `text` (then EOS, unless then_eos is False)."""
    h.backend.script = h.tokenizer.encode(text, add_special_tokens=False)
    h.backend.eos_at = len(h.backend.script) if then_eos else None


def last_prompt(h: Harness) -> str:
    """The text of the last prompt the fake shard was sent."""
    new = [r for plan in h.backend.shard.plans for r in plan.new_requests]
    return h.tokenizer.decode(new[-1].token_ids)


def openai_client(h: Harness) -> openai.AsyncOpenAI:
    """The official client on the in-process app."""
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=h.router.app), base_url="http://loom/v1")
    return openai.AsyncOpenAI(base_url="http://loom/v1", api_key="-", http_client=http, max_retries=0)


def router_config(**overrides: object) -> RouterConfig:
    fields: dict = dict(model_id="", shard_uds_paths=("fake.sock",), max_concurrent_requests=4,
                        max_total_tokens=MAX_TOTAL_TOKENS, max_stop_sequences=2, max_n=4, max_top_n_tokens=3)
    return RouterConfig(**{**fields, **overrides})


@pytest.fixture
async def harness(backend: FakeShardClient, tokenizer: Tokenizer) -> AsyncIterator[Harness]:
    router = await start_router(router_config(), backend, tokenizer)
    try:
        yield Harness(router.http, router.engine, backend, tokenizer, router)
    finally:
        await router.stop()


def sse_payloads(body: str) -> list:
    """The data of every SSE event, JSON-decoded except OpenAI's [DONE]."""
    events = [block for block in body.split("\n\n") if block.strip()]
    assert all(e.startswith("data: ") for e in events), events
    return [e[6:] if e[6:] == "[DONE]" else json.loads(e[6:]) for e in events]


def expected_ids(h: Harness, prompt: str | list[int], seed: int, count: int) -> list[int]:
    """What the fake shard generates for this prompt and seed, computed without the router."""
    ids = h.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    return h.backend.reference(ids, seed, count)


def expected_text(h: Harness, prompt: str | list[int], seed: int, count: int) -> str:
    return h.tokenizer.decode(expected_ids(h, prompt, seed, count))


def chat_ids(h: Harness, messages: list[dict]) -> list[int]:
    return h.tokenizer.encode(h.tokenizer.apply_chat_template(messages), add_special_tokens=False)


# ---- TGI routes ---------------------------------------------------------------------------


async def test_info_reports_model_and_limits(harness: Harness) -> None:
    info = (await harness.client.get("/info")).json()
    assert info["max_total_tokens"] == MAX_TOTAL_TOKENS and info["max_input_tokens"] == MAX_TOTAL_TOKENS - 1
    assert info["max_concurrent_requests"] == 4 and info["max_best_of"] == 4 and info["max_stop_sequences"] == 2
    assert info["model_dtype"] == "float32" and info["model_device_type"] == "cpu"
    assert info["max_batch_total_tokens"] == harness.backend.num_blocks * harness.backend.block_size
    assert isinstance(info["version"], str)
    assert info["model_id"] == "SmolLM2-135M-Instruct.Q4_1.gguf"  # the embedded default, named
    for name in ("default", "SmolLM2-135M-Instruct.Q4_1", info["model_id"]):  # /info's name is a `model` too
        body = {"model": name, "prompt": "x", "max_tokens": 1}
        assert (await harness.client.post("/v1/completions", json=body)).status_code == 200, name


async def test_health_follows_the_shards(harness: Harness) -> None:
    assert (await harness.client.get("/health")).status_code == 200
    harness.backend.healthy = False
    response = await harness.client.get("/health")
    assert response.status_code == 503 and response.json()["error_type"] == "unhealthy"


async def test_generate_greedy_with_details(harness: Harness) -> None:
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 5, "details": True, "seed": 3}}
    out = (await harness.client.post("/generate", json=body)).json()
    assert out["generated_text"] == expected_text(harness, "Hello", 3, 5)
    details = out["details"]
    assert details["finish_reason"] == "length" and details["generated_tokens"] == 5
    assert details["seed"] is None  # greedy: TGI reports no seed
    assert [t["id"] for t in details["tokens"]] == expected_ids(harness, "Hello", 3, 5)
    assert all(set(t) == {"id", "text", "logprob", "special"} for t in details["tokens"])
    assert details["prefill"] == [] and details["top_tokens"] == []


async def test_generate_without_details_has_only_text(harness: Harness) -> None:
    out = (await harness.client.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}})).json()
    assert set(out) == {"generated_text"}


async def test_max_new_tokens_unset_fills_the_context(harness: Harness) -> None:
    ids = harness.tokenizer.encode("Hello there")
    out = (await harness.client.post("/generate", json={"inputs": "Hello there",
                                                        "parameters": {"details": True}})).json()
    assert out["details"]["generated_tokens"] == MAX_TOTAL_TOKENS - len(ids)


async def test_eos_and_stop_sequences_finish(harness: Harness) -> None:
    harness.backend.eos_at = 2
    out = (await harness.client.post("/generate", json={"inputs": "x", "parameters": {"details": True}})).json()
    assert out["details"]["finish_reason"] == "eos_token" and out["details"]["generated_tokens"] == 3
    eos = out["details"]["tokens"][-1]  # named as TGI names it, and left out of the text
    assert eos["special"] and eos["text"] == harness.tokenizer.decode([eos["id"]]) != ""
    assert eos["text"] not in out["generated_text"]
    harness.backend.eos_at = None
    text = expected_text(harness, "x", 1, 10)
    stop = text[text.index(" ", 2):][:4]  # the start of the second word
    body = {"inputs": "x", "parameters": {"details": True, "stop": [stop], "max_new_tokens": 10, "seed": 1}}
    out = (await harness.client.post("/generate", json=body)).json()
    assert out["details"]["finish_reason"] == "stop_sequence"
    assert out["generated_text"].startswith(text[:text.index(stop) + len(stop)])  # TGI keeps the stop sequence
    # and the rest of the token that completed it: the tokens' texts join to the text
    assert out["generated_text"] == "".join(t["text"] for t in out["details"]["tokens"])
    mid_token = text[:text.index(stop) + len(stop) - 1]  # a stop that ends inside a token
    body["parameters"]["stop"] = [mid_token[-3:]]
    out = (await harness.client.post("/generate", json=body)).json()
    assert out["generated_text"] == "".join(t["text"] for t in out["details"]["tokens"])


async def test_return_full_text_and_truncate(harness: Harness) -> None:
    body = {"inputs": "one two three", "parameters": {"max_new_tokens": 2, "return_full_text": True,
                                                      "truncate": 1, "decoder_input_details": True,
                                                      "details": True}}
    out = (await harness.client.post("/generate", json=body)).json()
    assert out["generated_text"].startswith("one two three")
    prefill = out["details"]["prefill"]
    assert [t["id"] for t in prefill] == harness.tokenizer.encode("one two three")[-1:]
    assert prefill[0]["logprob"] is None


@pytest.mark.parametrize("details", [True, False])  # TGI: decoder_input_details alone asks for details too
async def test_decoder_input_details_give_prompt_logprobs(harness: Harness, details: bool) -> None:
    body = {"inputs": "one two three four", "parameters": {"max_new_tokens": 1, "details": details,
                                                           "decoder_input_details": True}}
    prefill = (await harness.client.post("/generate", json=body)).json()["details"]["prefill"]
    ids = harness.tokenizer.encode("one two three four")
    assert [t["id"] for t in prefill] == ids
    assert prefill[0]["logprob"] is None and all(isinstance(t["logprob"], float) for t in prefill[1:])


async def test_best_of_returns_the_best_and_the_others(harness: Harness) -> None:
    body = {"inputs": "x", "parameters": {"max_new_tokens": 3, "best_of": 3, "do_sample": True, "seed": 5,
                                          "details": True}}
    details = (await harness.client.post("/generate", json=body)).json()["details"]
    others = details["best_of_sequences"]
    assert len(others) == 2
    body["parameters"]["return_full_text"] = True  # the prompt before every sequence's text, as TGI's
    full = (await harness.client.post("/generate", json=body)).json()["details"]["best_of_sequences"]
    assert [o["generated_text"] for o in full] == ["x" + o["generated_text"] for o in others]
    assert sorted([details["seed"]] + [o["seed"] for o in others]) == [5, 6, 7]
    best = sum(t["logprob"] for t in details["tokens"])
    assert all(best >= sum(t["logprob"] for t in o["tokens"]) for o in others)


async def test_top_n_tokens(harness: Harness) -> None:
    body = {"inputs": "x", "parameters": {"max_new_tokens": 2, "top_n_tokens": 2, "details": True}}
    top = (await harness.client.post("/generate", json=body)).json()["details"]["top_tokens"]
    assert len(top) == 2 and all(len(step) == 2 for step in top)
    assert set(top[0][0]) == {"id", "text", "logprob", "special"}


async def test_generate_stream_sse_format(harness: Harness) -> None:
    body = {"inputs": "x", "parameters": {"max_new_tokens": 4, "details": True, "seed": 2}}
    response = await harness.client.post("/generate_stream", json=body)
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_payloads(response.text)
    assert [e["index"] for e in events] == [1, 2, 3, 4]
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    last = events[-1]
    assert last["generated_text"] == expected_text(harness, "x", 2, 4)
    assert last["details"]["finish_reason"] == "length" and last["details"]["generated_tokens"] == 4
    assert "".join(e["token"]["text"] for e in events) == last["generated_text"]


async def test_compat_route(harness: Harness) -> None:
    out = (await harness.client.post("/", json={"inputs": "x", "parameters": {"max_new_tokens": 2}})).json()
    assert isinstance(out, list) and out[0]["generated_text"]
    streamed = await harness.client.post("/", json={"inputs": "x", "stream": True,
                                                     "parameters": {"max_new_tokens": 2}})
    assert len(sse_payloads(streamed.text)) == 2


async def test_tokenize(harness: Harness) -> None:
    text = "Hello wörld, 123"
    tokens = (await harness.client.post("/tokenize", json={"inputs": text})).json()
    assert [t["id"] for t in tokens] == harness.tokenizer.encode(text)
    assert "".join(t["text"] for t in tokens) == text
    assert all(text[t["start"]:t["stop"]] == t["text"] for t in tokens)


@pytest.mark.parametrize("content, body_check", [
    (b"{not json", "not valid JSON"),
    (json.dumps({"inputs": 5}).encode(), "`inputs`"),
    (json.dumps({"inputs": "x", "parameters": {"temperature": "hot"}}).encode(), "parameters.temperature"),
    (json.dumps({"inputs": "x", "parameters": {"top_p": 1.5}}).encode(), "parameters.top_p"),
    (b'{"inputs": "x", "parameters": {"temperature": 1e999}}', "parameters.temperature"),  # reads as Infinity
    (b'{"inputs": "x", "parameters": {"repetition_penalty": Infinity}}', "parameters.repetition_penalty"),
    (b'{"inputs": "x", "parameters": {"truncate": 1180591620717411303424}}', "parameters.truncate"),  # 2**70
    (json.dumps({"inputs": ""}).encode(), "`inputs`: String should have at least 1 character"),
    (json.dumps({"inputs": "x", "parameters": {"stop": ["a", "b", "c"]}}).encode(), "stop sequences"),
    (json.dumps({"inputs": "x", "parameters": {"max_new_tokens": MAX_TOTAL_TOKENS}}).encode(),
     f"must be <= {MAX_TOTAL_TOKENS}"),
    (json.dumps({"inputs": "hi " * MAX_TOTAL_TOKENS}).encode(), f"less than {MAX_TOTAL_TOKENS} tokens"),
    (json.dumps({"inputs": "x", "parameters": {"watermark": True}}).encode(), "`watermark` is not supported"),
])
async def test_tgi_bad_requests_get_422_and_the_server_stays_healthy(harness: Harness, content: bytes,
                                                                     body_check: str) -> None:
    response = await harness.client.post("/generate", content=content,
                                         headers={"content-type": "application/json"})
    assert response.status_code == 422, response.text
    error = response.json()
    assert error["error_type"] == "validation" and body_check in error["error"], error
    assert (await harness.client.get("/health")).status_code == 200
    ok = await harness.client.post("/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 1}})
    assert ok.status_code == 200


def invalid_status(route: str) -> int:
    """An invalid request's status: TGI's 422, or 400 on OpenAI's and Anthropic's /v1 routes."""
    return 400 if route.startswith("/v1/") else 422


@pytest.mark.parametrize("route, content", [
    ("/generate", b'{"inputs": "a\\ud800b", "parameters": {"max_new_tokens": 2}}'),
    ("/generate", b'{"inputs": "ab", "parameters": {"max_new_tokens": 2, "stop": ["\\udfff"]}}'),
    ("/tokenize", b'{"inputs": "a\\ud800b"}'),
    ("/v1/completions", b'{"prompt": "a\\udc00", "max_tokens": 2}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}'),
])
async def test_a_lone_surrogate_is_refused(harness: Harness, route: str, content: bytes) -> None:
    """JSON can spell half of a UTF-16 pair (\ud800) that is no Unicode text: refused at the door."""
    response = await harness.client.post(route, content=content, headers={"content-type": "application/json"})
    assert response.status_code == invalid_status(route), response.text
    error = response.json()["error"]
    assert "surrogate" in (error["message"] if route.startswith("/v1/") else error)
    pair = await harness.client.post("/tokenize", content=b'{"inputs": "\\ud83d\\ude00"}',  # a whole pair: fine
                                     headers={"content-type": "application/json"})
    assert pair.status_code == 200 and "".join(t["text"] for t in pair.json()) == "\N{GRINNING FACE}"


async def test_overload_gives_429(harness: Harness) -> None:
    harness.backend.step_delay_s = 0.02
    body = {"inputs": "x", "parameters": {"max_new_tokens": 20}}
    running = [asyncio.create_task(harness.client.post("/generate", json=body)) for _ in range(4)]
    while harness.engine.stats().num_running + harness.engine.stats().num_waiting < 4:
        await asyncio.sleep(0.005)
    response = await harness.client.post("/generate", json=body)
    assert response.status_code == 429 and response.json()["error_type"] == "overloaded"
    assert [r.status_code for r in await asyncio.gather(*running)] == [200] * 4


async def test_shard_failure_gives_424_and_the_server_recovers(harness: Harness) -> None:
    harness.backend.fail_steps = True
    response = await harness.client.post("/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 2}})
    assert response.status_code == 424 and response.json()["error_type"] == "generation"
    harness.backend.fail_steps = False
    assert (await harness.client.get("/health")).status_code == 200


async def test_metrics_export_engine_and_request_metrics(harness: Harness) -> None:
    await harness.client.post("/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 3}})
    text = (await harness.client.get("/metrics")).text
    assert f"loom_kv_blocks_total {float(harness.backend.num_blocks)}" in text
    assert 'loom_http_requests_total{route="/generate",status="200"} 1.0' in text
    assert "loom_time_to_first_token_seconds_count 1.0" in text
    assert "loom_request_generated_tokens_sum 3.0" in text
    assert "loom_generated_tokens_total 3.0" in text
    assert 'loom_preemptions_total{kind="swap"} 0.0' in text


# ---- OpenAI routes ------------------------------------------------------------------------

CHAT = [{"role": "user", "content": "Hello"}]


async def test_models(harness: Harness) -> None:
    out = (await harness.client.get("/v1/models")).json()
    assert out["object"] == "list" and out["data"][0]["object"] == "model"
    assert out["data"][0]["id"] == "default" and out["data"][0]["max_model_len"] == MAX_TOTAL_TOKENS


async def test_completion(harness: Harness) -> None:
    body = {"model": "default", "prompt": "Hello", "max_tokens": 4, "temperature": 0, "seed": 8}
    out = (await harness.client.post("/v1/completions", json=body)).json()
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-")
    (choice,) = out["choices"]
    assert choice["text"] == expected_text(harness, "Hello", 8, 4)
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    n_prompt = len(harness.tokenizer.encode("Hello"))
    assert out["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 4, "total_tokens": n_prompt + 4,
                            "prompt_tokens_details": {"cached_tokens": 0}}


async def test_completion_prompt_as_token_ids_with_echo_and_logprobs(harness: Harness) -> None:
    ids = harness.tokenizer.encode("one two three")
    body = {"prompt": [ids], "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 2, "seed": 4}
    (choice,) = (await harness.client.post("/v1/completions", json=body)).json()["choices"]
    assert choice["text"] == "one two three" + expected_text(harness, ids, 4, 2)
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) + 2
    assert logprobs["token_logprobs"][0] is None and all(lp is not None for lp in logprobs["token_logprobs"][1:])
    # From the prompt's second token on: the token's own logprob and the top alternatives (the
    # fake shard puts the next token id first, more likely than the prompt's own).
    tops = logprobs["top_logprobs"]
    assert tops[0] is None
    for i in range(1, len(ids)):
        own = harness.tokenizer.decode([ids[i]])
        assert tops[i] == {harness.tokenizer.decode([ids[i] + 1]): 0.05, own: logprobs["token_logprobs"][i]}
    for top, logprob in zip(tops[len(ids):], logprobs["token_logprobs"][len(ids):]):
        assert 2 <= len(top) <= 3 and logprob in top.values()  # the alternatives and the token itself
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"] == sorted(logprobs["text_offset"])
    assert "".join(logprobs["tokens"]) == choice["text"]


async def test_completion_stream_with_usage(harness: Harness) -> None:
    body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0, "stream": True, "seed": 5,
            "stream_options": {"include_usage": True}}
    events = sse_payloads((await harness.client.post("/v1/completions", json=body)).text)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 3
    chunks = events[:-2]
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected_text(harness, "Hello", 5, 3)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_completion_stream_with_echo_and_logprobs(harness: Harness) -> None:
    body = {"prompt": "Hello", "max_tokens": 2, "stream": True, "echo": True, "logprobs": 1, "seed": 3}
    events = sse_payloads((await harness.client.post("/v1/completions", json=body)).text)
    opening, *chunks, done = events  # a chunk per token, or both in one when the reader fell behind
    assert opening["choices"][0]["text"] == "Hello" and done == "[DONE]"
    logprobs = [c["choices"][0]["logprobs"] for c in chunks]
    tokens = [token for lp in logprobs for token in lp["tokens"]]
    offsets = [offset for lp in logprobs for offset in lp["text_offset"]]
    assert offsets == [len("Hello"), len("Hello") + len(tokens[0])]
    tops = [top for lp in logprobs for top in lp["top_logprobs"]]  # the alternative, and the token itself
    assert len(tops) == 2 and all(1 <= len(top) <= 2 and token in top for top, token in zip(tops, tokens))
    assert "".join(c["choices"][0]["text"] for c in chunks) == "".join(tokens) == expected_text(harness, "Hello", 3, 2)


async def test_chat_completion_with_logprobs(harness: Harness) -> None:
    body = {"model": "default", "messages": CHAT, "max_completion_tokens": 3, "temperature": 0,
            "logprobs": True, "top_logprobs": 2, "seed": 6}
    out = (await harness.client.post("/v1/chat/completions", json=body)).json()
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    (choice,) = out["choices"]
    assert choice["message"] == {"role": "assistant",
                                 "content": expected_text(harness, chat_ids(harness, CHAT), 6, 3)}
    content = choice["logprobs"]["content"]
    assert len(content) == 3 and set(content[0]) == {"token", "logprob", "bytes", "top_logprobs"}
    assert bytes(content[0]["bytes"]).decode() == content[0]["token"] and len(content[0]["top_logprobs"]) == 2
    assert out["usage"]["prompt_tokens"] == len(chat_ids(harness, CHAT))


async def test_chat_stream_interleaves_n_choices(harness: Harness) -> None:
    body = {"messages": CHAT, "max_tokens": 3, "n": 2, "seed": 1, "stream": True,
            "choice_params": [{"temperature": 0, "seed": 40}]}
    events = sse_payloads((await harness.client.post("/v1/chat/completions", json=body)).text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}] * 2
    texts = {0: "", 1: ""}
    for chunk in chunks[2:]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["delta"]["content"]
    # choice 0 has its own seed; choice 1 samples with the request's seed + 1
    ids = chat_ids(harness, CHAT)
    assert texts[0] == expected_text(harness, ids, 40, 3)
    assert texts[1] == expected_text(harness, ids, 2, 3)
    finishes = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(finishes) == [0, 1]


async def test_chat_stop_sequence_maps_to_stop(harness: Harness) -> None:
    text = expected_text(harness, chat_ids(harness, CHAT), 9, 10)
    stop = text[text.index(" ", 2):][:4]
    body = {"messages": CHAT, "max_tokens": 10, "temperature": 0, "stop": stop, "seed": 9}
    (choice,) = (await harness.client.post("/v1/chat/completions", json=body)).json()["choices"]
    assert choice["message"]["content"] == text[:text.index(stop)] and choice["finish_reason"] == "stop"
    # vLLM's include_stop_str_in_output keeps it, streamed too
    body |= {"include_stop_str_in_output": True}
    (choice,) = (await harness.client.post("/v1/chat/completions", json=body)).json()["choices"]
    assert choice["message"]["content"] == text[:text.index(stop) + len(stop)] and choice["finish_reason"] == "stop"
    response = await harness.client.post("/v1/chat/completions", json={**body, "stream": True})
    chunks = [c for c in sse_payloads(response.text) if c != "[DONE]"]
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert streamed == text[:text.index(stop) + len(stop)]


async def test_chat_template_flags_and_variables(harness: Harness) -> None:
    async def prompt(**fields: object) -> str:
        response = await harness.client.post("/v1/chat/completions", json={"max_tokens": 1, **fields})
        assert response.status_code == 200, response.text
        return last_prompt(harness)

    prefill = [*CHAT, {"role": "assistant", "content": "Sure, the"}]
    opened = harness.tokenizer.apply_chat_template(CHAT)
    closed = harness.tokenizer.apply_chat_template(CHAT, add_generation_prompt=False)
    assert await prompt(messages=CHAT) == opened != closed
    assert await prompt(messages=CHAT, add_generation_prompt=False) == closed
    assert await prompt(messages=CHAT, chat_template_kwargs={"add_generation_prompt": False}) == closed
    assert await prompt(messages=prefill, continue_final_message=True) == opened + "Sure, the"
    assert await prompt(messages=prefill, chat_template_kwargs={"continue_final_message": True}) == opened + "Sure, the"
    assert await prompt(messages=CHAT, chat_template_kwargs={"self": 1, "x": 2}) == opened  # unused: no effect


async def test_stop_token_ids_end_a_choice_as_eos_does(harness: Harness) -> None:
    script(harness, " one two three four five", then_eos=False)
    ids = harness.backend.script
    stop_id = ids[2]  # " three": not a special token, so its text stays (vLLM's rule)
    for route, body in [("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": CHAT})]:
        for ignore_eos in (False, True):  # they apply whatever ignore_eos says
            response = await harness.client.post(route, json={**body, "max_tokens": 20, "stop_token_ids": [stop_id],
                                                              "ignore_eos": ignore_eos})
            (choice,) = response.json()["choices"]
            text = choice["text"] if "text" in choice else choice["message"]["content"]
            assert text == harness.tokenizer.decode(ids[:3]) and choice["finish_reason"] == "stop", choice
            assert response.json()["usage"]["completion_tokens"] == 3
    sampled = [p.sampling for plan in harness.backend.shard.plans for p in plan.new_requests][-1]
    assert stop_id in sampled.eos_token_ids  # min_tokens holds them back too
    response = await harness.client.post("/v1/completions", json={"prompt": "x", "stop_token_ids": [10**6]})
    assert response.status_code == 400 and "stop_token_ids" in response.text


async def test_chat_without_template_is_a_clear_400(harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(harness.tokenizer, "chat_template", None)
    response = await harness.client.post("/v1/chat/completions", json={"messages": CHAT})
    assert response.status_code == 400
    assert "no chat template" in response.json()["error"]["message"]


@pytest.mark.parametrize("route, body, param, message", [
    ("/v1/completions", {"prompt": "x", "n": 5}, "n", "`n` must be <= 4"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature", "temperature"),
    ("/v1/completions", {"prompt": ""}, "prompt", "`prompt` cannot be empty"),
    ("/v1/completions", {"prompt": [[1]] * 33}, "prompt", "at most 32 prompts (--max-client-batch-size)"),
    ("/v1/completions", {"prompt": [10**9]}, "prompt", "token ids must be in"),
    ("/v1/chat/completions", {"messages": []}, "messages", "at least 1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content",
     "`messages.0.content`: Input should be a valid string or Input should be a valid list"),
    ("/v1/chat/completions", {"messages": CHAT, "choice_params": [{}, {}]}, "choice_params", "more than `n`"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs",
     "`chat_template_kwargs` cannot set messages"),
    ("/v1/chat/completions", {"messages": CHAT, "continue_final_message": True, "add_generation_prompt": True},
     "continue_final_message", "cannot both be true"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages.0", "a `user` message needs `content`"),
    ("/v1/chat/completions", {"messages": CHAT, "functions": [{"name": "f", "parameters": {}}]}, "functions",
     "send `tools`"),
    ("/v1/chat/completions", {"messages": CHAT, "stream_options": {"include_usage": True}}, "stream_options",
     "only allowed when `stream` is true"),
    ("/v1/completions", {"prompt": "x", "stream": False, "stream_options": {}}, "stream_options", "`stream`"),
    ("/v1/chat/completions", {"messages": CHAT, "continue_final_message": True}, None,
     "needs it to be an assistant message"),
])
async def test_openai_bad_requests_get_400_in_openai_shape(harness: Harness, route: str, body: dict,
                                                           param: str | None, message: str) -> None:
    response = await harness.client.post(route, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and message in error["message"], error
    assert error["param"] == param and "code" in error


@pytest.mark.parametrize("route, content, param", [
    ("/v1/completions", b'{"prompt": "x", "temperature": 1e999}', "temperature"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "Hi"}], "repetition_penalty": Infinity}',
     "repetition_penalty"),
])
async def test_openai_infinite_numbers_are_refused(harness: Harness, route: str, content: bytes, param: str) -> None:
    response = await harness.client.post(route, content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param and "finite" in response.json()["error"]["message"]


async def test_openai_malformed_json(harness: Harness) -> None:
    response = await harness.client.post("/v1/chat/completions", content=b"{", headers={"content-type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]


UINT32_OVERFLOW = 2**32  # one past the shard protocol's uint32 fields


@pytest.mark.parametrize("route, body, field", [
    ("/generate", {"inputs": "x", "parameters": {"max_new_tokens": 2, "top_k": UINT32_OVERFLOW}}, "top_k"),
    ("/generate_stream", {"inputs": "x", "parameters": {"max_new_tokens": 2, "top_k": UINT32_OVERFLOW}}, "top_k"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "top_k": UINT32_OVERFLOW}, "top_k"),
    ("/v1/completions", {"prompt": "x", "min_tokens": UINT32_OVERFLOW}, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "n": 2, "temperature": 1.0,
                         "choice_params": [{}, {"top_k": UINT32_OVERFLOW}]}, "choice_params.1.top_k"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "top_k": UINT32_OVERFLOW}, "top_k"),
    ("/v1/chat/completions", {"messages": CHAT, "min_tokens": UINT32_OVERFLOW}, "min_tokens"),
])
async def test_an_integer_past_the_protocol_is_refused_and_hurts_no_other_request(
        harness: Harness, route: str, body: dict, field: str) -> None:
    """One request's out-of-range integer must not fail the step every other request is in."""
    harness.backend.step_delay_s = 0.01
    other = asyncio.create_task(harness.client.post(
        "/generate", json={"inputs": "the quick", "parameters": {"max_new_tokens": 12, "seed": 3, "do_sample": True}}))
    while harness.engine.stats().num_running == 0:
        await asyncio.sleep(0.005)
    response = await harness.client.post(route, json=body)
    assert response.status_code == invalid_status(route), response.text
    error = response.json()["error"]
    message = error["message"] if route.startswith("/v1/") else error
    assert field.rsplit(".", 1)[-1] in message, message
    if route.startswith("/v1/"):
        assert error["param"] == field
    finished = await other
    assert finished.status_code == 200, finished.text
    assert finished.json()["generated_text"] == expected_text(harness, "the quick", 3, 12)


async def test_openai_overload_is_429_in_openai_shape(harness: Harness) -> None:
    harness.backend.step_delay_s = 0.02
    body = {"prompt": "x", "max_tokens": 20}
    running = [asyncio.create_task(harness.client.post("/v1/completions", json=body)) for _ in range(4)]
    while harness.engine.stats().num_running + harness.engine.stats().num_waiting < 4:
        await asyncio.sleep(0.005)
    response = await harness.client.post("/v1/completions", json=body)
    assert response.status_code == 429 and response.json()["error"]["type"] == "rate_limit_error"
    await asyncio.gather(*running)


async def test_the_openapi_document_says_what_the_server_accepts_and_answers(harness: Harness) -> None:
    document = (await harness.client.get("/openapi.json")).json()
    schemas, paths = document["components"]["schemas"], document["paths"]
    assert schemas["TGIRequest"]["properties"]["inputs"]["minLength"] == 1  # "" is refused
    assert schemas["TokenizeRequest"]["properties"]["inputs"]["minLength"] == 1
    prompt = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    assert {"type": "string", "minLength": 1} in prompt and all(p.get("minItems") == 1 for p in prompt[1:])
    guided = [s for s in schemas["ConstraintFields" if "ConstraintFields" in schemas else "CompletionRequest"]
              ["properties"]["guided_choice"]["anyOf"] if s.get("type") == "array"]
    assert guided[0]["minItems"] == 1 and guided[0]["maxItems"] == 10_000
    assert "content" not in paths["/health"]["get"]["responses"]["200"]  # an empty 200, as TGI's
    assert set(paths["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert set(paths["/"]["get"]["responses"]) >= {"200", "406"} and "405" not in paths["/"]["get"]["responses"]
    health = await harness.client.get("/health")
    assert health.status_code == 200 and health.content == b""


@pytest.mark.parametrize("method, path, allow", [
    ("GET", "/generate", "POST"), ("OPTIONS", "/", "GET, POST"), ("PUT", "/v1/completions", "POST"),
    ("GET", "/tokenize", "POST"), ("POST", "/health", "GET"),
])
async def test_405_allows_every_method_the_document_lists(harness: Harness, method: str, path: str,
                                                         allow: str) -> None:
    response = await harness.client.request(method, path)
    assert response.status_code == 405 and response.headers["allow"] == allow


async def test_openapi_docs(harness: Harness) -> None:
    assert (await harness.client.get("/docs")).status_code == 200
    paths = (await harness.client.get("/openapi.json")).json()["paths"]
    assert {"/generate", "/generate_stream", "/", "/info", "/health", "/tokenize", "/metrics", "/v1/models",
            "/v1/completions", "/v1/chat/completions"} <= set(paths)


async def test_a_default_context_past_the_kv_cache_is_lowered_to_fit_it(tokenizer: Tokenizer) -> None:
    """The model's context (256) past what the KV cache holds for one request (32 blocks of 4):
    requests without a token limit run to what fits instead of being refused."""
    backend = FakeShardClient(tokenizer.encode(WORDS), tokenizer.vocab_size, eos_id=tokenizer.eos_token_ids[0],
                              num_blocks=32)
    router = await start_router(router_config(max_total_tokens=None), backend, tokenizer)
    try:
        info = (await router.http.get("/info")).json()
        capacity = router.engine.limits.num_usable_blocks * 4
        assert info["max_total_tokens"] == capacity < 256 and info["max_input_tokens"] == capacity - 1
        chat = await router.http.post("/v1/chat/completions", json={"messages": CHAT})
        assert chat.status_code == 200 and chat.json()["usage"]["total_tokens"] == capacity, chat.text
    finally:
        await router.stop()
