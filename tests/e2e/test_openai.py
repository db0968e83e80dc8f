"""The OpenAI API end to end with the official `openai` client, and n completions from one prefill."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from conftest import Launcher
from text_generation import Client

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def counter(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert len(client.models.list().data) == 1


def test_chat_stream_equals_non_stream(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model="loom", messages=QUESTION, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model="loom", messages=QUESTION, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content and text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    # SmolLM2's chat prompt for this question is 37 tokens with its default system prompt.
    assert full.usage.prompt_tokens == 37


def test_completions_stop_logprobs_and_echo(client: openai.OpenAI) -> None:
    plain = client.completions.create(model="loom", prompt="The sea is", max_tokens=16, temperature=0)
    text = plain.choices[0].text
    stop = text.split()[2]
    stopped = client.completions.create(model="loom", prompt="The sea is", max_tokens=16, temperature=0,
                                        stop=[stop], logprobs=2)
    assert stopped.choices[0].text == text[:text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    lp = stopped.choices[0].logprobs
    assert len(lp.token_logprobs) == len(lp.tokens) and all(v <= 0 for v in lp.token_logprobs)
    assert all(len(alts) == 2 for alts in lp.top_logprobs)
    echoed = client.completions.create(model="loom", prompt="The sea is", max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith("The sea is")


def test_chat_logprobs(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="loom", messages=QUESTION, max_tokens=6, temperature=0,
                                         logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert item.logprob == pytest.approx(max(t.logprob for t in item.top_logprobs), abs=1e-4)


def test_seed_reproducible_and_n4_choices_differ(client: openai.OpenAI) -> None:
    def ask() -> list[str]:
        out = client.chat.completions.create(model="loom", messages=QUESTION, max_tokens=12, temperature=1.0,
                                             n=4, seed=1234)
        assert [c.index for c in out.choices] == [0, 1, 2, 3]
        return [c.message.content for c in out.choices]

    first = ask()
    assert ask() == first
    assert len(set(first)) > 1


def test_n4_prefills_the_prompt_once(server: Launcher, client: openai.OpenAI) -> None:
    prompt = "In a quiet village by the mountains there lived an old clockmaker who " * 4
    before = counter(server.base_url, "loom_prompt_tokens_computed_total")
    out = client.completions.create(model="loom", prompt=prompt, max_tokens=4, temperature=0.8, n=4, seed=7)
    grown = counter(server.base_url, "loom_prompt_tokens_computed_total") - before
    assert len(out.choices) == 4
    assert grown == out.usage.prompt_tokens - out.usage.prompt_tokens_details.cached_tokens


def test_choice_params_greedy_choice_equals_greedy_answer(server: Launcher, client: openai.OpenAI) -> None:
    greedy = client.chat.completions.create(model="loom", messages=QUESTION, max_tokens=12, temperature=0)
    mixed = client.chat.completions.create(
        model="loom", messages=QUESTION, max_tokens=12, n=2, seed=5,
        extra_body={"choice_params": [{"temperature": 0}, {"temperature": 1.2, "top_p": 0.9}]})
    assert mixed.choices[0].message.content == greedy.choices[0].message.content


def test_n_streaming_interleaves_choices(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model="loom", prompt="Once upon a time", max_tokens=6, n=3,
                                            temperature=1.0, seed=3, stream=True))
    indices = [c.choices[0].index for c in chunks if c.choices]
    assert set(indices) == {0, 1, 2}
    assert indices != sorted(indices)  # interleaved, not one choice after another


def test_async_client_and_errors(server: Launcher) -> None:
    async def go() -> None:
        aclient = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="none", timeout=120)
        out = await aclient.completions.create(model="loom", prompt="Hello", max_tokens=3, temperature=0)
        assert out.usage.completion_tokens <= 3 and out.choices[0].text
        with pytest.raises(openai.BadRequestError) as err:
            await aclient.completions.create(model="loom", prompt="Hello", max_tokens=3, n=99)
        assert "n" in str(err.value)
        with pytest.raises(openai.BadRequestError):
            await aclient.chat.completions.create(model="loom", messages=QUESTION, temperature="hot")  # type: ignore[arg-type]

    asyncio.run(go())


def test_best_of_returns_the_highest_logprob_sequence(server: Launcher) -> None:
    client = Client(server.base_url, timeout=120)
    response = client.generate("My favourite animal is", max_new_tokens=8, best_of=3, do_sample=True)
    others = response.details.best_of_sequences
    assert len(others) == 2
    best = sum(t.logprob for t in response.details.tokens)
    assert all(best >= sum(t.logprob for t in seq.tokens) for seq in others)
