"""Reasoning split (`<think>`, gpt-oss's harmony channels) and the tool-call formats of each family,
whole and streamed."""

from __future__ import annotations

import json

import pytest

from loom_router.frontend import harmony, reasoning, tool_parsers
from loom_router.frontend.harmony import HarmonyStream
from loom_router.frontend.reasoning import Part, ReasoningStream
from loom_router.frontend.tool_parsers import ToolFormat

NAMES = {"get_weather", "get_time"}


def _streamed(text: str, in_reasoning: bool, cut: int) -> tuple[str, str]:
    """Reasoning and content of text fed in pieces of `cut` characters."""
    stream = ReasoningStream(in_reasoning)
    pieces = [p for i in range(0, len(text), cut) for p in stream.feed(text[i : i + cut])] + stream.finish()
    return ("".join(t for k, t in pieces if k is Part.REASONING), "".join(t for k, t in pieces if k is Part.CONTENT))


@pytest.mark.parametrize("cut", [1, 2, 3, 7, 100])
def test_thinking_splits_the_same_whole_or_in_any_pieces(cut: int) -> None:
    text = "<think>\nIt rains in Oslo.\n</think>\n\nTake an umbrella."
    whole = reasoning.split(text, in_reasoning=False)
    assert (whole.reasoning, whole.content) == ("It rains in Oslo.", "Take an umbrella.")
    assert _streamed(text, False, cut) == ("It rains in Oslo.", "Take an umbrella.")
    # A prompt that opened <think>: the answer starts inside it.
    assert _streamed("Hm.\n</think>\n\nYes.", True, cut) == ("Hm.", "Yes.")
    # Whitespace inside the reasoning stays; around it, it goes, as in the whole split.
    assert _streamed(" a  b \n c \n", True, cut) == ("a  b \n c", "")
    assert reasoning.split(" a  b \n c \n", True) == reasoning.Split("a  b \n c", None)
    # No tags at all: all content; thinking cut short (length): all reasoning.
    assert _streamed("Just an answer <b>.", False, cut) == ("", "Just an answer <b>.")
    assert reasoning.split("<think>\nstill thinking", False) == reasoning.Split("still thinking", None)


def test_which_templates_reason_and_where_prompts_leave_off() -> None:
    assert reasoning.applies("... <think>\n ... </think> ...") and not reasoning.applies("<|im_start|>")
    assert reasoning.starts_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not reasoning.starts_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not reasoning.starts_in_reasoning("<|im_start|>assistant\n")


def test_the_format_comes_from_the_template() -> None:
    assert tool_parsers.tool_format("{{ '<tool_call>' }}") is ToolFormat.HERMES
    assert tool_parsers.tool_format("{{ '<|python_tag|>' }}") is ToolFormat.LLAMA3_JSON
    assert tool_parsers.tool_format('Environment: ipython ... "parameters"') is ToolFormat.LLAMA3_JSON
    assert tool_parsers.tool_format("{{ '[TOOL_CALLS]' }}") is ToolFormat.MISTRAL
    assert tool_parsers.tool_format(None) is ToolFormat.HERMES


def _arguments(parsed: tool_parsers.ParsedOutput) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls]


def test_each_format_parses_its_calls() -> None:
    oslo = {"city": "Oslo"}
    hermes = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    parsed = tool_parsers.parse(ToolFormat.HERMES, hermes, NAMES)
    assert parsed.content == "Sure." and _arguments(parsed) == [("get_weather", oslo)]
    llama = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}'
    assert _arguments(tool_parsers.parse(ToolFormat.LLAMA3_JSON, llama, NAMES)) == [("get_weather", oslo), ("get_time", {})]
    mistral = 'On it.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    parsed = tool_parsers.parse(ToolFormat.MISTRAL, mistral, NAMES)
    assert parsed.content == "On it." and _arguments(parsed) == [("get_weather", oslo)]
    newer = '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}'
    assert _arguments(tool_parsers.parse(ToolFormat.MISTRAL, newer, NAMES)) == [("get_weather", oslo), ("get_time", {})]
    bare = '[{"name": "get_time", "arguments": {}}]'  # what the forcing grammar writes
    assert _arguments(tool_parsers.parse(ToolFormat.MISTRAL, bare, NAMES)) == [("get_time", {})]


@pytest.mark.parametrize(("fmt", "text"), [
    (ToolFormat.HERMES, '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'),  # an unknown tool
    (ToolFormat.LLAMA3_JSON, '{"answer": 42}'),  # JSON, but no call
    (ToolFormat.LLAMA3_JSON, "The weather is fine."),
    (ToolFormat.MISTRAL, '[TOOL_CALLS][{"name": "get_weather", "arguments": "Oslo"}]'),  # arguments not an object
])
def test_anything_else_stays_content(fmt: ToolFormat, text: str) -> None:
    assert tool_parsers.parse(fmt, text, NAMES) == tool_parsers.ParsedOutput(text, [])


@pytest.mark.parametrize("text", [
    "You can use the <tool_call> function to get the weather in Madrid. Here is how",  # a marker in prose
    '<tool_call>\n{"name": "get_weather Berlin", "arguments": {}}\n</tool_call>\nThen I would say',  # no such tool
    '<tool_call>\n{"name": "rm_rf", "argu',  # cut off in a call to no known tool
])
def test_an_answer_cut_off_keeps_what_is_no_call_as_content(text: str) -> None:
    assert tool_parsers.parse(ToolFormat.HERMES, text, NAMES, cut_off=True) == tool_parsers.ParsedOutput(text, [])


@pytest.mark.parametrize(("text", "content", "calls"), [
    ("Let me check. <tool_call>\n{", "Let me check.", []),  # no name yet: the call is dropped
    ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"ci', "Let me check.",
     [("get_weather", '{"ci')]),  # a partial call
    ('A <tool_call> in prose, then <tool_call>\n{"name": "get_ti', "A <tool_call> in prose, then", []),
    ('Sure <tool_call>{"arguments": {"name": "Bob", "age": 3', "Sure", []),  # a "name" inside the arguments
])
def test_an_answer_cut_off_in_a_call_drops_its_markup(text: str, content: str, calls: list) -> None:
    parsed = tool_parsers.parse(ToolFormat.HERMES, text, NAMES, cut_off=True)
    assert parsed.content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in parsed.tool_calls] == calls


def test_where_calls_start_and_what_a_stream_holds_back() -> None:
    assert tool_parsers.call_start(ToolFormat.HERMES, "ok <tool_call>{") == 3
    assert tool_parsers.held_tail(ToolFormat.HERMES, "ok <tool") == len("<tool")
    assert tool_parsers.call_start(ToolFormat.MISTRAL, "ok [TOOL_CALLS][") == 3
    assert tool_parsers.held_tail(ToolFormat.MISTRAL, "ok [TOOL") == len("[TOOL")
    assert tool_parsers.call_start(ToolFormat.LLAMA3_JSON, '  {"name"') == 0
    assert tool_parsers.call_start(ToolFormat.LLAMA3_JSON, "The {x}") is None
    assert tool_parsers.held_tail(ToolFormat.LLAMA3_JSON, "<|pyth") == len("<|pyth")


def test_each_format_writes_back_earlier_calls() -> None:
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "utc"}'}}]
    assert tool_parsers.calls_as_text(ToolFormat.LLAMA3_JSON, calls) == '{"name": "get_time", "parameters": {"zone": "utc"}}'
    assert tool_parsers.calls_as_text(ToolFormat.MISTRAL, calls) == '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "utc"}}]'
    assert '"zone": "utc"' in tool_parsers.calls_as_text(ToolFormat.HERMES, calls)


HARMONY_ANSWER = ("<|channel|>analysis<|message|>Need the weather tool.<|end|>"
                  "<|start|>assistant<|channel|>commentary<|message|>Checking Oslo.<|end|>"
                  "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                  '{"city": "Oslo"}<|call|>')


@pytest.mark.parametrize("cut", [1, 2, 5, 13, 1000])
def test_harmony_channels_split_the_same_whole_or_in_any_pieces(cut: int) -> None:
    def streamed(text: str) -> tuple[str, str]:
        stream = HarmonyStream()
        pieces = [p for i in range(0, len(text), cut) for p in stream.feed(text[i : i + cut])] + stream.finish()
        return ("".join(t for k, t in pieces if k is Part.REASONING), "".join(t for k, t in pieces if k is Part.CONTENT))

    reasoning_text, content = streamed(HARMONY_ANSWER)
    assert reasoning_text == "Need the weather tool."
    # The preamble is content; the call reaches the Hermes reader as a Hermes call.
    parsed = tool_parsers.parse(ToolFormat.HERMES, content, NAMES)
    assert parsed.content == "Checking Oslo."
    assert [c["function"] for c in parsed.tool_calls] == [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    final = "<|channel|>analysis<|message|>2 + 2.<|end|><|start|>assistant<|channel|>final<|message|>It is 4."
    assert streamed(final) == ("2 + 2.", "It is 4.")
    # The recipient in the role part of the header; a built-in tool's call stays reasoning.
    assert "get_time" in streamed('<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>')[1]
    assert streamed("<|channel|>analysis to=python<|message|>print(1)<|call|>") == ("print(1)", "")
    # Not harmony at all (a grammar's JSON, a model ignoring the format): content, as written.
    assert streamed('{"a": 1}') == ("", '{"a": 1}')
    assert streamed("x" * 100) == ("", "x" * 100)


def test_harmony_templates_are_recognised() -> None:
    template = "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}<|start|>assistant"
    assert not harmony.applies(template)
    assert harmony.applies(template + "{# <|channel|>final #}")
