"""Request models of both APIs: ranges and types give clear errors; defaults and conversions."""

from __future__ import annotations

import pydantic
import pytest
from fastapi.exceptions import RequestValidationError

from loom_router.frontend.validation import (
    SEED_LIMIT,
    ChatCompletionRequest,
    CompletionRequest,
    Limits,
    TGIParameters,
    TGIRequest,
    check_openai,
    check_tgi,
    choice_seed,
    openai_generation_params,
    tgi_generation_params,
)
from loom_router.types import ValidationError

LIMITS = Limits(max_stop_sequences=2, max_top_n_tokens=3, max_n=4, vocab_size=100, eos_token_ids=(2,))
CHAT = [{"role": "user", "content": "hi"}]


# ---- TGI ---------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("temperature", 0.0), ("temperature", -1.0), ("top_k", 0), ("top_p", 0.0), ("top_p", 1.0),
    ("typical_p", 1.0), ("repetition_penalty", 0.0), ("frequency_penalty", 2.5), ("frequency_penalty", -2.1),
    ("seed", -1), ("seed", SEED_LIMIT), ("truncate", 0), ("best_of", 0), ("max_new_tokens", 0),
    ("top_n_tokens", -1),
])
def test_tgi_out_of_range_values_are_rejected_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(pydantic.ValidationError) as err:
        TGIParameters.model_validate({field: value})
    assert err.value.errors()[0]["loc"] == (field,)


@pytest.mark.parametrize("field, value", [
    ("temperature", "0.5"), ("top_k", 1.5), ("do_sample", "yes"), ("do_sample", 1), ("stop", "x"),
    ("max_new_tokens", "10"), ("details", "true"),
])
def test_tgi_wrong_types_are_rejected_not_coerced(field: str, value: object) -> None:
    with pytest.raises(pydantic.ValidationError):
        TGIParameters.model_validate({field: value})


def test_tgi_inputs_must_be_a_string() -> None:
    with pytest.raises(pydantic.ValidationError):
        TGIRequest.model_validate({"inputs": 5})
    with pytest.raises(pydantic.ValidationError):
        TGIRequest.model_validate({})


def test_tgi_accepts_what_the_official_client_sends() -> None:
    # text_generation.Client sends every field, most as null
    body = {"inputs": "hi", "stream": False, "parameters": {
        "best_of": None, "details": True, "decoder_input_details": False, "do_sample": False,
        "max_new_tokens": 20, "repetition_penalty": None, "frequency_penalty": None, "return_full_text": False,
        "seed": None, "stop": [], "temperature": None, "top_k": None, "top_p": None, "truncate": None,
        "typical_p": None, "watermark": False, "top_n_tokens": None, "grammar": None, "adapter_id": None}}
    req = TGIRequest.model_validate(body)
    check_tgi(req.parameters, req.inputs, req.stream, LIMITS)
    params = tgi_generation_params(req.parameters, 20, LIMITS)
    assert params.n == 1 and params.max_new_tokens == 20
    sampling = params.choices[0]
    assert not sampling.do_sample and sampling.top_k is None and sampling.repetition_penalty is None
    assert sampling.eos_token_ids == (2,)
    assert 0 <= sampling.seed < SEED_LIMIT


@pytest.mark.parametrize("params, inputs, stream, message", [
    ({}, "", False, "`inputs` cannot be empty"),
    ({"stop": ["a", "b", "c"]}, "x", False, "up to 2 stop sequences"),
    ({"top_n_tokens": 4}, "x", False, "`top_n_tokens` must be <= 3"),
    ({"best_of": 5, "do_sample": True}, "x", False, "`best_of` must be <= 4"),
    ({"best_of": 2}, "x", False, "you must use sampling"),
    ({"best_of": 2, "do_sample": True}, "x", True, "not supported when streaming"),
    ({"decoder_input_details": True}, "x", True, "not supported when streaming"),
])
def test_tgi_server_limits(params: dict, inputs: str, stream: bool, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        check_tgi(TGIParameters.model_validate(params), inputs, stream, LIMITS)


def test_tgi_sampling_follows_tgi_warpers() -> None:
    assert not TGIParameters().sampling
    assert not TGIParameters(temperature=1.0).sampling  # a no-op warper does not switch sampling on
    assert TGIParameters(temperature=0.7).sampling
    assert TGIParameters(top_k=5).sampling
    assert TGIParameters(do_sample=True).sampling


def test_tgi_best_of_gives_consecutive_seeds_and_shared_settings() -> None:
    params = TGIParameters(best_of=3, top_p=0.9, seed=41, repetition_penalty=1.2, top_n_tokens=2,
                           stop=["", "END"], decoder_input_details=True)
    gen = tgi_generation_params(params, 7, LIMITS)
    assert [c.seed for c in gen.choices] == [41, 42, 43]
    assert all(c.do_sample and c.top_p == 0.9 and c.repetition_penalty == 1.2 and c.top_n_tokens == 2
               for c in gen.choices)
    assert gen.stop_sequences == ["END"]  # an empty stop sequence would end every request at once
    assert gen.prompt_logprobs and gen.max_new_tokens == 7


def test_choice_seed_wraps_inside_63_bits() -> None:
    assert choice_seed(SEED_LIMIT - 1, 2) == 1


# ---- OpenAI ------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", 2.1), ("top_p", 0.0), ("top_p", 1.5), ("n", 0),
    ("max_tokens", -1), ("presence_penalty", 3.0), ("frequency_penalty", -3.0), ("min_p", 1.5),
    ("logit_bias", {"5": 101.0}), ("min_tokens", -1), ("seed", -5),
])
def test_openai_out_of_range_values_are_rejected_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(pydantic.ValidationError) as err:
        CompletionRequest.model_validate({"prompt": "x", field: value})
    assert err.value.errors()[0]["loc"][0] == field


@pytest.mark.parametrize("body", [
    {"messages": []},
    {"messages": [{"role": "wizard", "content": "x"}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
    {"messages": CHAT, "temperature": "hot"},
    {"messages": CHAT, "top_logprobs": 2},  # needs logprobs: true
    {"messages": CHAT, "top_logprobs": 21, "logprobs": True},
    {"messages": "hi"},
])
def test_chat_rejects_malformed_requests(body: dict) -> None:
    with pytest.raises(pydantic.ValidationError):
        ChatCompletionRequest.model_validate(body)


def test_chat_content_parts_and_developer_role() -> None:
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ], "unknown_field": 1})
    assert [m.as_template_message() for m in req.messages] == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]


def test_openai_defaults_sample_with_temperature_one() -> None:
    req = ChatCompletionRequest.model_validate({"messages": CHAT})
    assert req.requested_max_tokens is None
    gen = openai_generation_params(req, 30, LIMITS)
    (choice,) = gen.choices
    assert choice.do_sample and choice.temperature == 1.0 and choice.top_p is None
    assert gen.max_new_tokens == 30 and not gen.prompt_logprobs


def test_openai_temperature_zero_is_greedy() -> None:
    req = CompletionRequest.model_validate({"prompt": "x", "temperature": 0, "top_k": -1})
    (choice,) = openai_generation_params(req, 5, LIMITS).choices
    assert not choice.do_sample and choice.top_k is None


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    req = ChatCompletionRequest.model_validate({"messages": CHAT, "max_tokens": 9, "max_completion_tokens": 4})
    assert req.requested_max_tokens == 4


def test_openai_full_conversion() -> None:
    req = CompletionRequest.model_validate({
        "prompt": [1, 2, 3], "n": 3, "seed": 10, "temperature": 0.5, "top_p": 0.8, "top_k": 4, "min_p": 0.1,
        "stop": "##", "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1,
        "logit_bias": {"7": -100, "9": 5}, "logprobs": 2, "echo": True, "ignore_eos": True, "min_tokens": 3,
        "choice_params": [{"temperature": 0}, {"temperature": 1.2, "top_p": 0.9, "seed": 99}],
    })
    check_openai(req, LIMITS)
    gen = openai_generation_params(req, 8, LIMITS)
    first, second, third = gen.choices
    assert not first.do_sample and first.seed == 10
    assert second.do_sample and second.temperature == 1.2 and second.top_p == 0.9 and second.seed == 99
    assert third.do_sample and third.temperature == 0.5 and third.top_p == 0.8 and third.seed == 12
    for c in gen.choices:
        assert c.top_k == 4 and c.min_p == 0.1 and c.presence_penalty == 0.5 and c.frequency_penalty == -0.5
        assert c.repetition_penalty == 1.1 and c.logit_bias == {7: -100.0, 9: 5.0}
        assert c.top_n_tokens == 2 and c.min_new_tokens == 3
    assert gen.stop_sequences == ["##"] and gen.ignore_eos and gen.prompt_logprobs


@pytest.mark.parametrize("body, message", [
    ({"n": 5}, "`n` must be <= 4"),
    ({"n": 1, "choice_params": [{}, {}]}, "more than `n`"),
    ({"stop": ["a", "b", "c"]}, "up to 2 stop sequences"),
    ({"logprobs": 4}, "at most 3 top logprobs"),
    ({"logit_bias": {"abc": 1}}, "keys must be token ids"),
    ({"logit_bias": {"100": 1}}, "outside the vocabulary"),
    ({"min_tokens": 5, "max_tokens": 4}, "`min_tokens` \\(5\\) must be <= `max_tokens` \\(4\\)"),
])
def test_openai_server_limits(body: dict, message: str) -> None:
    req = CompletionRequest.model_validate({"prompt": "x", **body})
    with pytest.raises(ValidationError, match=message):
        check_openai(req, LIMITS)


def test_a_translated_body_that_breaks_a_chat_bound_is_the_clients_error() -> None:
    # another API's body as a chat request: a bound broken there is a 422 naming the field, not a 500
    with pytest.raises(RequestValidationError) as err:
        ChatCompletionRequest.translated({"messages": CHAT, "top_k": 2**31})
    assert err.value.errors()[0]["loc"] == ("top_k",)
    assert ChatCompletionRequest.translated({"messages": CHAT, "top_k": 5}).top_k == 5


def test_chat_logprobs_map_to_top_n_tokens() -> None:
    req = ChatCompletionRequest.model_validate({"messages": CHAT, "logprobs": True, "top_logprobs": 3})
    check_openai(req, LIMITS)
    assert openai_generation_params(req, 1, LIMITS).choices[0].top_n_tokens == 3
    plain = ChatCompletionRequest.model_validate({"messages": CHAT, "logprobs": True})
    assert openai_generation_params(plain, 1, LIMITS).choices[0].top_n_tokens == 0


def test_completion_prompt_forms() -> None:
    for prompt in ("text", ["text"], [1, 2], [[1, 2]]):
        assert CompletionRequest.model_validate({"prompt": prompt}).prompt == prompt
    with pytest.raises(pydantic.ValidationError):
        CompletionRequest.model_validate({"prompt": 5})


def test_null_means_default_for_every_field() -> None:
    req = ChatCompletionRequest.model_validate({"messages": CHAT, "n": None, "stream": None, "logprobs": None,
                                                "stop": None, "ignore_eos": None, "temperature": None})
    assert req.n == 1 and not req.stream and not req.logprobs and req.stop_sequences == []
    assert TGIRequest.model_validate({"inputs": "x", "parameters": None}).parameters == TGIParameters()
    with pytest.raises(pydantic.ValidationError):
        CompletionRequest.model_validate({"prompt": None})  # a required field stays required
