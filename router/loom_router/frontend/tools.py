"""OpenAI tool calling on the chat route, in the model family's own format (`tool_parsers`: Hermes
`<tool_call>`, Llama 3 JSON, Mistral `[TOOL_CALLS]`), and a reasoning model's thinking returned
apart as `reasoning_content` (`reasoning`).

`tool_choice` "required" or a named function forces calls through a grammar (each call's JSON
validated against the tool's parameters, admitting only their listed keys): a named function gets
exactly one call; "required" one call, or with `parallel_tool_calls: true` one or more, the answer
free to end after any of them. "auto" lets the model choose and parses what it wrote; "none"
ignores the tools. A call cut off by max_tokens comes back as a partial call once its name is
complete (dropped before). Responses carry `message.tool_calls` with JSON `arguments` and
`finish_reason: "tool_calls"`.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator

from loom_router.frontend import harmony, reasoning, tool_parsers
from loom_router.frontend.tool_parsers import HERMES_CLOSE, HERMES_OPEN, ParsedOutput, ToolFormat
from loom_router.structured.spec import ConstraintSpec
from loom_router.types import FinishReason, ValidationError

CALL_OPEN, CALL_CLOSE = HERMES_OPEN, HERMES_CLOSE  # the format of templates that say nothing of tools


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class FunctionDef(_Model):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"] = "function"
    function: NamedFunction


class ToolFields(_Model):
    """The chat request's tool fields."""

    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # None (unset): a model may write several calls under "auto", one when forced ("required")
    parallel_tool_calls: bool | None = None
    # OpenAI's deprecated form of tools: refused by name rather than ignored
    functions: list[Any] | None = None
    function_call: Any = None

    @model_validator(mode="after")
    def _no_legacy_functions(self) -> ToolFields:
        if self.functions or self.function_call is not None:
            raise ValueError("`functions` and `function_call` (deprecated by OpenAI) are not supported: "
                             "send `tools` and `tool_choice`")
        return self


class ToolMode(enum.Enum):
    NONE = "none"  # plain chat
    AUTO = "auto"  # the model may call; its output is parsed
    FORCED = "forced"  # required or named: a grammar makes the output tool calls only


@dataclass(slots=True)
class ToolPlan:
    mode: ToolMode
    tools: list[Tool] = field(default_factory=list)
    spec: ConstraintSpec | None = None  # the grammar of a forced call
    format: ToolFormat = ToolFormat.HERMES
    one_call: bool = False  # auto with parallel_tool_calls false: calls past the first are dropped

    @property
    def template_tools(self) -> list[dict[str, Any]]:
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    @property
    def names(self) -> set[str]:
        return {tool.function.name for tool in self.tools}


def plan_tools(fields: ToolFields, fmt: ToolFormat = ToolFormat.HERMES) -> ToolPlan:
    """What the request's tool fields ask for, in the model's format. Raises ValidationError (422)."""
    tools = fields.tools or []
    choice = fields.tool_choice if fields.tool_choice is not None else ("auto" if tools else "none")
    if choice == "none":
        return ToolPlan(ToolMode.NONE, format=fmt)
    if not tools:
        raise ValidationError("`tool_choice` needs `tools`")
    names = [tool.function.name for tool in tools]
    if len(set(names)) != len(names):
        raise ValidationError("`tools` has two functions with the same name")
    if choice == "auto":
        return ToolPlan(ToolMode.AUTO, tools, format=fmt, one_call=fields.parallel_tool_calls is False)
    chosen = tools
    if isinstance(choice, NamedToolChoice):
        chosen = [tool for tool in tools if tool.function.name == choice.function.name]
        if not chosen:
            raise ValidationError(f"`tool_choice` names {choice.function.name!r}, which is not in `tools`")
    # no `parameters`: a function of no parameters (OpenAI's reading), whose arguments are {}
    schemas = [(t.function.name, t.function.parameters or {"type": "object", "properties": {}}) for t in chosen]
    # A named function is called once; "required" writes more calls only when asked to, since a
    # model free to go on after a complete call often does, until max_tokens.
    parallel = choice == "required" and fields.parallel_tool_calls is True
    return ToolPlan(ToolMode.FORCED, tools, tool_parsers.grammar(fmt, schemas, parallel), fmt)


# ---- the prompt ---------------------------------------------------------------------------


def tools_system_prompt(tools: list[Tool]) -> str:
    """The Hermes tool prompt, for chat templates that do not render `tools` themselves."""
    signatures = "\n".join(json.dumps(tool.model_dump(exclude_none=True)) for tool in tools)
    return ("You may call one or more functions to assist with the user query. The functions are:\n"
            f"<tools>\n{signatures}\n</tools>\n"
            "For each call, return a JSON object with the function name and arguments within "
            f'{CALL_OPEN}{CALL_CLOSE} tags:\n{CALL_OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n'
            f"{CALL_CLOSE}")


def with_tools_prompt(messages: list[dict[str, Any]], tools: list[Tool]) -> list[dict[str, Any]]:
    """Messages with the tool prompt added to (or as) the system message."""
    prompt = tools_system_prompt(tools)
    if messages and messages[0].get("role") == "system":
        first = {**messages[0], "content": f"{messages[0].get('content') or ''}\n\n{prompt}".strip()}
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def calls_as_text(tool_calls: list[dict[str, Any]]) -> str:
    """An earlier assistant turn's tool_calls, written back in the Hermes format."""
    return tool_parsers.calls_as_text(ToolFormat.HERMES, tool_calls)


def template_inputs(tokenizer: Any, messages: list[dict[str, Any]],
                    plan: ToolPlan) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and extra variables to render: `tools` goes to the template; a template
    that does not use it gets the Hermes tool prompt, and earlier calls as Hermes text. Earlier
    calls' JSON `arguments` reach templates as objects (what they write back with `tojson`)."""
    messages = [_with_argument_objects(m) for m in messages]
    if plan.mode is ToolMode.NONE:
        return messages, {}
    if "tools" in (tokenizer.chat_template or ""):
        return messages, {"tools": plan.template_tools}
    written = [{**m, "content": (m.get("content") or "") + calls_as_text(m["tool_calls"])} if m.get("tool_calls")
               else m for m in messages]
    return with_tools_prompt(written, plan.tools), {"tools": plan.template_tools}


def _with_argument_objects(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    converted = []
    for call in calls:
        function = dict(call.get("function") or {})
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                function["arguments"] = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        converted.append({**call, "function": function})
    return {**message, "tool_calls": converted}


# ---- the answer ---------------------------------------------------------------------------


def parse_output(text: str, plan: ToolPlan, reason: FinishReason | None = None) -> ParsedOutput:
    """Split an answer into content and tool calls (to the plan's tools, with a JSON object of
    arguments; the first only when the plan allows one, as vLLM keeps it). With no valid call
    the whole text stays content, except a call cut off by max_tokens (`reason` LENGTH): that
    one is a partial call."""
    parsed = tool_parsers.parse(plan.format, text, plan.names, reason is FinishReason.LENGTH)
    if plan.one_call and len(parsed.tool_calls) > 1:
        parsed.tool_calls = parsed.tool_calls[:1]
    return parsed


def finish_reason(parsed: ParsedOutput, reason: FinishReason | None) -> str | None:
    if reason is None:
        return None
    if parsed.tool_calls and reason is not FinishReason.LENGTH:
        return "tool_calls"
    return reason.openai


@dataclass(slots=True, frozen=True)
class AnswerFormat:
    """How a chat answer is read: tool calls (in the plan's format) and reasoning."""

    tools: ToolPlan
    reasoning: reasoning.Style | None = None  # how the model's template marks reasoning
    starts_in_reasoning: bool = False  # the prompt left a <think> open

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the answer's text must keep special tokens: harmony's markers, Mistral's
        [TOOL_CALLS] (control tokens, read by the parsers)."""
        return self.reasoning is reasoning.Style.HARMONY or (
            self.tools.mode is not ToolMode.NONE and self.tools.format is ToolFormat.MISTRAL)

    def reasoning_stream(self) -> reasoning.ReasoningStream | harmony.HarmonyStream | None:
        if self.reasoning is reasoning.Style.HARMONY:
            return harmony.HarmonyStream()
        if self.reasoning is reasoning.Style.THINK_TAGS:
            return reasoning.ReasoningStream(self.starts_in_reasoning)
        return None


def tool_format_of(chat_template: str | None) -> ToolFormat:
    """The tool-call format a template teaches; harmony's calls are read as Hermes (`harmony`)."""
    return ToolFormat.HERMES if harmony.applies(chat_template) else tool_parsers.tool_format(chat_template)


def answer_format(plan: ToolPlan, chat_template: str | None, prompt: str) -> AnswerFormat:
    """How to read the answer to `prompt`, rendered by `chat_template`. A forced call's grammar
    writes no harmony messages, so its answer is read as plain text."""
    if harmony.applies(chat_template):
        return AnswerFormat(plan, None if plan.mode is ToolMode.FORCED else reasoning.Style.HARMONY)
    if reasoning.applies(chat_template):
        return AnswerFormat(plan, reasoning.Style.THINK_TAGS, reasoning.starts_in_reasoning(prompt))
    return AnswerFormat(plan)


def chat_message(answer: AnswerFormat | ToolPlan, text: str,
                 reason: FinishReason | None) -> tuple[dict[str, Any], str | None]:
    """A whole chat choice's message and finish_reason."""
    if isinstance(answer, ToolPlan):
        answer = AnswerFormat(answer)
    reasoning_text: str | None = None
    stream = answer.reasoning_stream()
    if stream is not None:
        split = reasoning.split_with(stream, text)
        reasoning_text, text = split.reasoning, split.content or ""
    plan = answer.tools
    message: dict[str, Any] = {"role": "assistant"}
    if reasoning_text is not None:
        message["reasoning_content"] = reasoning_text
    if plan.mode is ToolMode.NONE:
        message["content"] = text if text or reasoning_text is None else None
        return message, reason.openai if reason else None
    parsed = parse_output(text, plan, reason)
    message["content"] = parsed.content
    if parsed.tool_calls:
        message["tool_calls"] = parsed.tool_calls
    return message, finish_reason(parsed, reason)


def open_prefix_length(text: str, fmt: ToolFormat = ToolFormat.HERMES) -> int:
    """How many trailing characters of text could still grow into the start of a call (held
    back while streaming, so a tool call is never half sent as content)."""
    return tool_parsers.held_tail(fmt, text)


def chat_constraint_spec(spec: ConstraintSpec | None, plan: ToolPlan) -> ConstraintSpec | None:
    """The chat request's one grammar: a response format, or a forced tool call."""
    if spec is not None and plan.spec is not None:
        raise ValidationError("a forced `tool_choice` cannot be combined with `response_format` or a constraint")
    return spec if spec is not None else plan.spec
