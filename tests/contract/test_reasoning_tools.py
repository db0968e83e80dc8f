"""Reasoning and tool formats through the OpenAI chat route (real Engine, fake shard): the model's
own template decides. `<think>` text comes back as `reasoning_content` (whole and streamed), and
tool calls are parsed in the family's format (Hermes, Llama 3 JSON, Mistral), or forced in it;
gpt-oss's harmony channels become reasoning_content, content and tool calls."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import jsonschema
import pytest
from api_fakes import FakeShardClient
from router_harness import start_router
from test_api import Harness, router_config, sse_payloads
from test_structured import TOOL_PARAMS, WEATHER

from loom_router.tokenizer import Tokenizer

MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]
THINKING = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
            "{# a <think> ... </think> model #}")
OPENS_THINKING = THINKING.replace("<|im_start|>assistant\n", "<|im_start|>assistant\n<think>\n")
LLAMA3 = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if tools %}Environment: ipython\n"
          'Answer with {"name": function name, "parameters": arguments}. {{ tools | tojson }}{% endif %}'
          "{# <|python_tag|> #}assistant:")
MISTRAL = ("{% for m in messages %}[INST]{{ m.content }}[/INST]{% endfor %}"
           "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}{# [TOOL_CALLS] #}")


def _with_template(tokenizer: Tokenizer, template: str) -> Tokenizer:
    return Tokenizer(tokenizer._backend, tokenizer.eos_token_ids, tokenizer.bos_token_id, template)


async def _harness(tokenizer: Tokenizer, answer: str | None) -> AsyncIterator[Harness]:
    backend = FakeShardClient(tokenizer.encode("the"), tokenizer.vocab_size, eos_id=tokenizer.eos_token_ids[0],
                              max_position_embeddings=512)
    if answer is not None:  # every sequence writes it, then stops
        backend.script = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_ids[0]]
    router = await start_router(router_config(max_total_tokens=400), backend, tokenizer)
    try:
        yield Harness(router.http, router.engine, backend, tokenizer, router)
    finally:
        await router.stop()


async def _chat(h: Harness, stream: bool = False, **body: object) -> httpx.Response:
    response = await h.client.post("/v1/chat/completions",
                                   json={"messages": MESSAGES, "max_tokens": 60, "stream": stream, **body})
    assert response.status_code == 200, response.text
    return response


def _deltas(response: httpx.Response) -> list[dict]:
    return [p["choices"][0] for p in sse_payloads(response.text) if isinstance(p, dict) and p.get("choices")]


@pytest.mark.parametrize(("template", "answer"), [
    (THINKING, "<think>\nOslo is in Norway.\n</think>\n\nIt is 12C."),
    (OPENS_THINKING, "Oslo is in Norway.\n</think>\n\nIt is 12C."),  # the prompt opened <think>
])
async def test_thinking_comes_back_as_reasoning_content(tokenizer: Tokenizer, template: str, answer: str) -> None:
    async for h in _harness(_with_template(tokenizer, template), answer):
        message = (await _chat(h)).json()["choices"][0]["message"]
        assert message["reasoning_content"] == "Oslo is in Norway."
        assert message["content"] == "It is 12C."
        deltas = _deltas(await _chat(h, stream=True))
        reasoning = "".join(d["delta"].get("reasoning_content") or "" for d in deltas)
        content = "".join(d["delta"].get("content") or "" for d in deltas)
        assert reasoning.strip() == "Oslo is in Norway." and content == "It is 12C."
        assert "<think>" not in reasoning + content and deltas[-1]["finish_reason"] == "stop"


async def test_enable_thinking_false_reaches_the_template(tokenizer: Tokenizer) -> None:
    async for h in _harness(_with_template(tokenizer, THINKING), "It is 12C."):
        message = (await _chat(h, chat_template_kwargs={"enable_thinking": False})).json()["choices"][0]["message"]
        assert message == {"role": "assistant", "content": "It is 12C."}
        assert h.backend.shard.plans[0].new_requests[0].token_ids[-6:]  # the prompt closed an empty <think>
        prompt = h.tokenizer.decode(h.backend.shard.plans[0].new_requests[0].token_ids)
        assert prompt.endswith("<think>\n\n</think>\n\n")


LLAMA3_CALL = '{"name": "get_weather", "parameters": {"unit": "c", "city": "Oslo"}}'
MISTRAL_CALL = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"unit": "c", "city": "Oslo"}}]'


@pytest.mark.parametrize(("template", "answer"), [(LLAMA3, LLAMA3_CALL), (MISTRAL, "Checking." + MISTRAL_CALL)])
async def test_calls_are_parsed_in_the_family_format(tokenizer: Tokenizer, template: str, answer: str) -> None:
    async for h in _harness(_with_template(tokenizer, template), answer):
        choice = (await _chat(h, tools=[WEATHER])).json()["choices"][0]
        (call,) = choice["message"]["tool_calls"]
        assert call["function"] == {"name": "get_weather", "arguments": '{"unit": "c", "city": "Oslo"}'}
        assert choice["finish_reason"] == "tool_calls"
        deltas = _deltas(await _chat(h, stream=True, tools=[WEATHER]))
        content = "".join(d["delta"].get("content") or "" for d in deltas)
        assert "get_weather" not in content and "TOOL_CALLS" not in content  # never half sent as content
        arguments = "".join(t["function"].get("arguments", "") for d in deltas for t in d["delta"].get("tool_calls", []))
        assert arguments == '{"unit": "c", "city": "Oslo"}' and deltas[-1]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("template", [LLAMA3, MISTRAL])
async def test_forced_calls_follow_the_family_format(tokenizer: Tokenizer, template: str) -> None:
    async for h in _harness(_with_template(tokenizer, template), None):  # a random walk through the grammar
        for seed in range(3):
            out = (await _chat(h, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                               seed=seed, max_tokens=80)).json()
            choice = out["choices"][0]
            assert choice["finish_reason"] == "tool_calls", choice
            (call,) = choice["message"]["tool_calls"]
            jsonschema.validate(json.loads(call["function"]["arguments"]), TOOL_PARAMS["get_weather"])


HARMONY = ("{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
           "{% if tools %}<|start|>developer<|message|>namespace functions {{ tools | tojson }}<|end|>{% endif %}"
           "<|start|>assistant{# <|channel|>final #}")
HARMONY_CALL = ("<|channel|>analysis<|message|>Need the weather tool.<|end|><|start|>assistant<|channel|>commentary "
                'to=functions.get_weather <|constrain|>json<|message|>{"unit": "c", "city": "Oslo"}<|call|>')


async def test_gpt_oss_harmony_channels_become_reasoning_content_and_tool_calls(tokenizer: Tokenizer) -> None:
    async for h in _harness(_with_template(tokenizer, HARMONY), HARMONY_CALL):
        choice = (await _chat(h, tools=[WEATHER], max_tokens=200)).json()["choices"][0]
        assert choice["message"]["reasoning_content"] == "Need the weather tool."
        (call,) = choice["message"]["tool_calls"]
        assert call["function"] == {"name": "get_weather", "arguments": '{"unit": "c", "city": "Oslo"}'}
        assert choice["finish_reason"] == "tool_calls" and not choice["message"]["content"]
        deltas = _deltas(await _chat(h, stream=True, tools=[WEATHER], max_tokens=200))
        reasoning = "".join(d["delta"].get("reasoning_content") or "" for d in deltas)
        content = "".join(d["delta"].get("content") or "" for d in deltas)
        assert reasoning == "Need the weather tool." and content == ""
        arguments = "".join(t["function"].get("arguments", "") for d in deltas for t in d["delta"].get("tool_calls", []))
        assert arguments == '{"unit": "c", "city": "Oslo"}' and deltas[-1]["finish_reason"] == "tool_calls"
    answer = "<|channel|>analysis<|message|>Simple.<|end|><|start|>assistant<|channel|>final<|message|>It is 12C."
    async for h in _harness(_with_template(tokenizer, HARMONY), answer):
        message = (await _chat(h, max_tokens=200)).json()["choices"][0]["message"]
        assert message == {"role": "assistant", "reasoning_content": "Simple.", "content": "It is 12C."}
