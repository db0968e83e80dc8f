"""/v1/completions as lm-eval and the openai client use it (prompt lists, echo with prompt
logprobs and their alternatives, max_tokens 0), and OpenAI's error details (unknown model,
context length, suffix), through the official `openai` client against the in-process router."""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest
from api_fakes import FakeShardClient
from router_harness import start_router
from test_api import MAX_TOTAL_TOKENS, Harness, expected_text, openai_client, router_config

from loom_router.tokenizer import Tokenizer


@pytest.fixture
async def harness(backend: FakeShardClient, tokenizer: Tokenizer) -> AsyncIterator[Harness]:
    router = await start_router(router_config(max_concurrent_requests=16, max_client_batch_size=4), backend,
                                tokenizer)
    try:
        yield Harness(router.http, router.engine, backend, tokenizer, router)
    finally:
        await router.stop()


@pytest.fixture
def client(harness: Harness) -> openai.AsyncOpenAI:
    return openai_client(harness)


async def test_echo_scores_every_prompt_token_from_the_second_with_its_alternatives(
        harness: Harness, client: openai.AsyncOpenAI) -> None:
    ids = harness.tokenizer.encode("one two three four")
    # lm-eval's loglikelihood request: echo, logprobs 1, max_tokens 1, greedy
    out = await client.completions.create(model="default", prompt=[ids], echo=True, logprobs=1, max_tokens=1,
                                          temperature=0)
    logprobs = out.choices[0].logprobs
    assert len(logprobs.tokens) == len(ids) + 1
    assert logprobs.top_logprobs[0] is None and logprobs.token_logprobs[0] is None
    for i in range(1, len(ids)):
        own = harness.tokenizer.decode([ids[i]])
        top = logprobs.top_logprobs[i]
        assert top[own] == logprobs.token_logprobs[i]  # the token itself, whatever its rank
        assert max(top.values()) == 0.05  # and the most likely alternative (the fake shard's next id)


async def test_tokens_holding_part_of_a_character_are_keyed_by_their_bytes_as_openai_writes_them(
        harness: Harness, client: openai.AsyncOpenAI) -> None:
    ids = harness.tokenizer.encode("emoji \U0001F600 here", add_special_tokens=False)  # ' \xf0\x9f\x98', '\x80'
    out = await client.completions.create(model="default", prompt=[ids], echo=True, logprobs=1, max_tokens=0)
    logprobs = out.choices[0].logprobs
    keys = [key for top in logprobs.top_logprobs[1:] for key in top]
    assert "bytes: \\xf0\\x9f\\x98" in keys and "bytes:\\x80" in keys and "\ufffd" not in "".join(keys)
    for i in range(1, len(ids)):  # each token's own logprob under its own key
        assert logprobs.token_logprobs[i] in logprobs.top_logprobs[i].values()


async def test_max_tokens_zero_with_echo_scores_the_prompt_and_generates_nothing(
        harness: Harness, client: openai.AsyncOpenAI) -> None:
    out = await client.completions.create(model="default", prompt="one two three", echo=True, logprobs=0,
                                          max_tokens=0)
    (choice,) = out.choices
    assert choice.text == "one two three" and choice.finish_reason == "length"
    num_prompt = len(harness.tokenizer.encode("one two three"))
    assert len(choice.logprobs.tokens) == num_prompt and choice.logprobs.token_logprobs[1] is not None
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == num_prompt
    with pytest.raises(openai.BadRequestError, match="needs `echo`"):
        await client.completions.create(model="default", prompt="x", max_tokens=0)


async def test_a_list_of_prompts_gets_n_choices_each_in_openai_order(
        harness: Harness, client: openai.AsyncOpenAI) -> None:
    prompts = ["one", "two three", "four"]
    out = await client.completions.create(model="default", prompt=prompts, max_tokens=3, n=2, seed=5)
    assert [c.index for c in out.choices] == list(range(6))
    for c in out.choices:  # index = prompt_index * n + choice; choice j samples with seed + j
        assert c.text == expected_text(harness, prompts[c.index // 2], 5 + c.index % 2, 3)
    num_prompt = sum(len(harness.tokenizer.encode(p)) for p in prompts)
    assert out.usage.prompt_tokens == num_prompt and out.usage.completion_tokens == 18
    ids = [harness.tokenizer.encode(p) for p in prompts]
    by_ids = await client.completions.create(model="default", prompt=ids, max_tokens=3, seed=5)
    assert [c.text for c in by_ids.choices] == [expected_text(harness, p, 5, 3) for p in prompts]


async def test_a_list_of_prompts_streams_each_choice_under_its_index(
        harness: Harness, client: openai.AsyncOpenAI) -> None:
    prompts = ["one", "two three"]
    texts = {i: "" for i in range(4)}
    finished = set()
    stream = await client.completions.create(model="default", prompt=prompts, max_tokens=3, n=2, seed=5,
                                             stream=True, echo=True)
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1, 2, 3}
    for index, text in texts.items():
        prompt = prompts[index // 2]
        assert text == prompt + expected_text(harness, prompt, 5 + index % 2, 3)


async def test_a_streamed_echo_with_logprobs_carries_the_prompts_logprobs_as_the_whole_response_does(
        client: openai.AsyncOpenAI) -> None:
    prompts = ["one two three", "four five"]
    whole = await client.completions.create(model="default", prompt=prompts, max_tokens=2, seed=3, echo=True,
                                            logprobs=1)
    fields = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    streamed: dict[int, dict[str, list]] = {i: {f: [] for f in fields} for i in range(2)}
    stream = await client.completions.create(model="default", prompt=prompts, max_tokens=2, seed=3, echo=True,
                                             logprobs=1, stream=True)
    async for chunk in stream:
        for c in chunk.choices:
            for f in fields:
                streamed[c.index][f] += getattr(c.logprobs, f)
    for c in whole.choices:
        assert streamed[c.index] == {f: getattr(c.logprobs, f) for f in fields}
        assert streamed[c.index]["token_logprobs"][1] is not None  # the prompt's, from its second token


async def test_prompts_past_the_client_batch_limit_are_refused(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="--max-client-batch-size"):
        await client.completions.create(model="default", prompt=["a"] * 5, max_tokens=1)


async def test_a_prompt_past_the_context_refuses_the_whole_request(
        harness: Harness, client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        await client.completions.create(model="default", prompt=["one", "two " * MAX_TOTAL_TOKENS], max_tokens=2)
    assert error.value.code == "context_length_exceeded"
    assert harness.engine.stats().num_running == 0 and harness.engine.stats().num_waiting == 0


async def test_models_by_id_and_unknown_models(harness: Harness, client: openai.AsyncOpenAI) -> None:
    assert (await client.models.retrieve("default")).id == "default"
    with pytest.raises(openai.NotFoundError) as error:
        await client.models.retrieve("gpt-4o")
    assert error.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as error:
        await client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "Hi"}])
    assert error.value.code == "model_not_found" and error.value.body["param"] == "model"
    response = await harness.client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert response.status_code == 200  # no `model`: the served one


async def test_context_length_exceeded_and_suffix_are_400(client: openai.AsyncOpenAI) -> None:
    long_prompt = "word " * (MAX_TOTAL_TOKENS + 5)
    with pytest.raises(openai.BadRequestError) as error:
        await client.completions.create(model="default", prompt=long_prompt, max_tokens=1)
    assert error.value.code == "context_length_exceeded" and "maximum context length" in error.value.message
    assert error.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as error:
        await client.chat.completions.create(model="default", messages=[{"role": "user", "content": long_prompt}])
    assert error.value.code == "context_length_exceeded" and error.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as error:
        await client.responses.create(model="default", input=long_prompt)
    assert error.value.code == "context_length_exceeded" and error.value.param == "input"
    with pytest.raises(openai.BadRequestError) as error:
        await client.completions.create(model="default", prompt="x", max_tokens=MAX_TOTAL_TOKENS)
    assert error.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as error:
        await client.completions.create(model="default", prompt="def f(", suffix="return 1", max_tokens=2)
    assert error.value.body["param"] == "suffix"


async def test_best_of_returns_the_n_choices_with_the_highest_logprob_per_token(
        harness: Harness, client: openai.AsyncOpenAI) -> None:
    every = await client.completions.create(model="default", prompt="one two", n=4, max_tokens=3, logprobs=0, seed=7)
    mean = {c.text: sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in every.choices}
    best = await client.completions.create(model="default", prompt="one two", n=2, best_of=4, max_tokens=3,
                                           logprobs=0, seed=7)
    assert [c.index for c in best.choices] == [0, 1]
    assert [c.text for c in best.choices] == sorted(mean, key=mean.__getitem__, reverse=True)[:2]
    assert best.usage.completion_tokens == 4 * 3  # every candidate was generated
    for fields, message in [({"n": 3, "best_of": 2}, "must be >= `n`"), ({"best_of": 2, "stream": True}, "cannot stream"),
                            ({"best_of": 99}, "must be <="),
                            ({"best_of": 2, "choice_params": [{"temperature": 0}]}, "cannot be combined")]:
        with pytest.raises(openai.BadRequestError, match=message):
            await client.completions.create(model="default", prompt="x", max_tokens=2, extra_body=fields)


async def test_completions_without_max_tokens_generate_openais_default_of_16(
        harness: Harness, client: openai.AsyncOpenAI) -> None:
    out = await client.completions.create(model="default", prompt="one two")
    (choice,) = out.choices
    assert out.usage.completion_tokens == 16 and choice.finish_reason == "length"
