"""The router's grammar compiler and mask filler (llguidance) and the tool-call helpers."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest

from loom_proto.step import Fork, NewRequest, RunningRequest, SamplingParams, StepPlan
from loom_router.frontend.tool_stream import tool_chunks
from loom_router.frontend.tools import (
    ToolFields,
    ToolMode,
    chat_message,
    open_prefix_length,
    parse_output,
    plan_tools,
    template_inputs,
)
from loom_router.structured.grammar import ConstraintKind, ConstraintSpec, GrammarCompiler, MaskFiller, allowed_ids
from loom_router.structured.spec import MAX_CHOICES
from loom_router.tokenizer import Tokenizer, load_tokenizer
from loom_router.types import ChoiceEvent, FinishReason, GeneratedToken, ValidationError

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer("")


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer)


def test_equal_sources_compile_once(compiler: GrammarCompiler) -> None:
    a = compiler.compile(ConstraintSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}))
    b = compiler.compile(ConstraintSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}))
    assert a is b
    # the properties' order is the output's: another order is another grammar
    ab = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
    ba = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}}
    assert compiler.compile(ConstraintSpec.json_schema(ab)) is not compiler.compile(ConstraintSpec.json_schema(ba))
    assert compiler.compile(ConstraintSpec(ConstraintKind.REGEX, "a+")) is not a


@pytest.mark.parametrize("spec, reason", [
    (ConstraintSpec(ConstraintKind.REGEX, "[a-"), "unclosed character class"),
    (ConstraintSpec.json_schema({"type": "foo"}), "Invalid type: foo"),
    (ConstraintSpec(ConstraintKind.LARK, "start: nowhere"), 'grammar \\(Lark or GBNF\\): .*unknown name: "nowhere"'),
])
def test_a_grammar_that_cannot_compile_names_the_reason(compiler: GrammarCompiler, spec: ConstraintSpec,
                                                        reason: str) -> None:
    with pytest.raises(ValidationError, match=reason):
        compiler.compile(spec)


@pytest.mark.parametrize("num_options", [3, 2_500, MAX_CHOICES])  # past 2,000, one parser rule of them failed
def test_a_choice_of_up_to_max_choices_options_is_exactly_one_of_them(compiler: GrammarCompiler,
                                                                    tokenizer: Tokenizer, num_options: int) -> None:
    options = [f"option {i}" for i in range(num_options)] + ["option 1 and more"]
    grammar = compiler.compile(ConstraintSpec.choice(options[-MAX_CHOICES:]))
    for chosen in (options[-2], options[-1]):
        matcher = grammar.new_matcher()
        assert all(matcher.consume(t) for t in tokenizer.encode(chosen, add_special_tokens=False))
        assert matcher.consume(tokenizer.eos_token_ids[0]) and matcher.is_finished, chosen
    wrong = grammar.new_matcher()
    assert not all(wrong.consume(t) for t in tokenizer.encode("option x", add_special_tokens=False))


def test_masks_follow_each_matcher(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    grammar = compiler.compile(ConstraintSpec(ConstraintKind.REGEX, "(ab|cd)e"))
    first, second = grammar.new_matcher(), grammar.new_matcher()
    for token_id in tokenizer.encode("ab", add_special_tokens=False):
        assert first.consume(token_id)
    plan = StepPlan(
        new_requests=[NewRequest(8, [1, 2], 2, 0, 2, [0], SamplingParams(seed=0),
                                 forks=[Fork(9, SamplingParams(seed=1), [1])])],
        running_requests=[RunningRequest(3, 1)],
    )
    MaskFiller(compiler).fill(plan, {3: first, 9: second}.get)
    assert set(plan.allowed_token_masks) == {3, 9}  # 8 is unconstrained
    after_ab = {tokenizer.decode([int(t)]) for t in allowed_ids(plan.allowed_token_masks[3])}
    assert after_ab == {"e"}
    at_start = {tokenizer.decode([int(t)]) for t in allowed_ids(plan.allowed_token_masks[9])}
    assert "a" in at_start and "c" in at_start and "e" not in at_start
    assert tokenizer.eos_token_ids[0] not in allowed_ids(plan.allowed_token_masks[9])  # EOS only at the end
    for token_id in tokenizer.encode("e", add_special_tokens=False):
        first.consume(token_id)
    assert first.is_finished


def test_parse_hermes_calls_and_content() -> None:
    plan = plan_tools(ToolFields.model_validate({"tools": [WEATHER]}))
    call_text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    parsed = parse_output("Let me check.\n" + call_text, plan)
    assert parsed.content == "Let me check."
    (call,) = parsed.tool_calls
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    unknown = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert parse_output(unknown, plan).tool_calls == [] and parse_output(unknown, plan).content == unknown
    assert len(parse_output(call_text + "\n" + call_text, plan).tool_calls) == 2
    one = plan_tools(ToolFields.model_validate({"tools": [WEATHER], "parallel_tool_calls": False}))
    assert len(parse_output(call_text + "\n" + call_text, one).tool_calls) == 1  # the first only, as vLLM


def test_tool_plans_and_messages() -> None:
    assert plan_tools(ToolFields()).mode is ToolMode.NONE
    assert plan_tools(ToolFields.model_validate({"tools": [WEATHER]})).mode is ToolMode.AUTO
    forced = plan_tools(ToolFields.model_validate({"tools": [WEATHER], "tool_choice": "required"}))
    assert forced.mode is ToolMode.FORCED and forced.spec is not None and "get_weather" in forced.spec.source
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    message, finish = chat_message(forced, text, FinishReason.EOS)
    assert finish == "tool_calls" and message["content"] is None and len(message["tool_calls"]) == 1
    assert chat_message(forced, text[:20], FinishReason.LENGTH)[1] == "length"


def test_a_template_without_tools_gets_the_tool_prompt(tokenizer: Tokenizer) -> None:
    plan = plan_tools(ToolFields.model_validate({"tools": [WEATHER]}))
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "content": "12C", "tool_call_id": "c1"}]
    rendered, extra = template_inputs(tokenizer, messages, plan)
    assert extra == {"tools": plan.template_tools}
    assert rendered[0]["role"] == "system" and "<tools>" in rendered[0]["content"]
    assert '"city": "Oslo"' in rendered[2]["content"]
    prompt = tokenizer.apply_chat_template(rendered, True, extra=extra)
    assert "get_weather" in prompt and "12C" in prompt


def test_open_prefix_length() -> None:
    assert open_prefix_length("hello <tool") == len("<tool")
    assert open_prefix_length("hello") == 0 and open_prefix_length("a <") == 1


async def test_auto_stream_sends_content_then_call_deltas() -> None:
    plan = plan_tools(ToolFields.model_validate({"tools": [WEATHER]}))
    pieces = ["Sure", ". <tool", '_call>\n{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}\n</tool_call>']

    async def batches() -> AsyncIterator[list[ChoiceEvent]]:  # a token at a time, as a reader keeping up gets them
        for i, text in enumerate(pieces):
            reason = FinishReason.EOS if i == len(pieces) - 1 else None
            yield [ChoiceEvent(0, GeneratedToken(i, text, 0.0, False), text, reason)]

    reply = SimpleNamespace(include_usage=False, envelope=lambda obj, choices: {"object": obj, "choices": choices})
    writes = [c async for c in tool_chunks(reply, plan, 1, None, batches(), lambda p, n: {})]
    chunks = [event.decode() + "\n\n" for write in writes for event in write.split(b"\n\n") if event]
    deltas = [json.loads(c[6:])["choices"][0] for c in chunks if c.startswith("data: {")]
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    assert content == "Sure. "  # "<tool" was held back, never sent as content
    calls = [t for d in deltas for t in d["delta"].get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert "".join(t["function"]["arguments"] for t in calls) == '{"city": "Oslo"}'
    assert deltas[-1]["finish_reason"] == "tool_calls" and chunks[-1] == "data: [DONE]\n\n"
