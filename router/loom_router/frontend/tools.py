"""OpenAI tool calling on the chat route, in the Hermes format models are trained on:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`tool_choice` "required" or a named function forces that format through a grammar (each
call's JSON validated against the tool's parameters); "auto" lets the model choose and
parses what it wrote; "none" ignores the tools. Responses carry `message.tool_calls` with
JSON `arguments` and `finish_reason: "tool_calls"`.
"""

from __future__ import annotations

import enum
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from loom_router.structured.spec import JSON_LAYOUT, ConstraintKind, ConstraintSpec
from loom_router.types import FinishReason, ValidationError

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL_RE = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.DOTALL)


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
    parallel_tool_calls: bool = True


class ToolMode(enum.Enum):
    NONE = "none"  # plain chat
    AUTO = "auto"  # the model may call; its output is parsed
    FORCED = "forced"  # required or named: a grammar makes the output tool calls only


@dataclass(slots=True)
class ToolPlan:
    mode: ToolMode
    tools: list[Tool] = field(default_factory=list)
    spec: ConstraintSpec | None = None  # the grammar of a forced call

    @property
    def template_tools(self) -> list[dict[str, Any]]:
        return [tool.model_dump(exclude_none=True) for tool in self.tools]


def plan_tools(fields: ToolFields) -> ToolPlan:
    """What the request's tool fields ask for. Raises ValidationError (422)."""
    tools = fields.tools or []
    choice = fields.tool_choice if fields.tool_choice is not None else ("auto" if tools else "none")
    if choice == "none":
        return ToolPlan(ToolMode.NONE)
    if not tools:
        raise ValidationError("`tool_choice` needs `tools`")
    names = [tool.function.name for tool in tools]
    if len(set(names)) != len(names):
        raise ValidationError("`tools` has two functions with the same name")
    if choice == "auto":
        return ToolPlan(ToolMode.AUTO, tools)
    if isinstance(choice, NamedToolChoice):
        chosen = [tool for tool in tools if tool.function.name == choice.function.name]
        if not chosen:
            raise ValidationError(f"`tool_choice` names {choice.function.name!r}, which is not in `tools`")
        return ToolPlan(ToolMode.FORCED, tools, _calls_grammar(chosen, fields.parallel_tool_calls))
    return ToolPlan(ToolMode.FORCED, tools, _calls_grammar(tools, fields.parallel_tool_calls))


def _calls_grammar(tools: list[Tool], parallel: bool) -> ConstraintSpec:
    """A Lark grammar: one Hermes call (or several, when parallel) whose JSON matches a tool."""
    variants = [_call_schema(tool) for tool in tools]
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    schema = {**schema, "x-guidance": JSON_LAYOUT}
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    call = f'call: {json.dumps(CALL_OPEN + chr(10))} %json {json.dumps(schema)} {json.dumps(chr(10) + CALL_CLOSE)}'
    return ConstraintSpec(ConstraintKind.LARK, f"{start}\n{call}\n")


def _call_schema(tool: Tool) -> dict[str, Any]:
    parameters = tool.function.parameters or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": tool.function.name}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


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
    parts = []
    for call in tool_calls:
        function = call.get("function") or {}
        arguments = function.get("arguments") or "{}"
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            pass
        parts.append(f"{CALL_OPEN}\n{json.dumps({'name': function.get('name'), 'arguments': arguments})}\n{CALL_CLOSE}")
    return "\n".join(parts)


# ---- the answer ---------------------------------------------------------------------------


@dataclass(slots=True)
class ParsedOutput:
    content: str | None
    tool_calls: list[dict[str, Any]]  # OpenAI's message.tool_calls entries


def parse_output(text: str, tools: list[Tool]) -> ParsedOutput:
    """Splits a Hermes-format output into content and tool calls (to known tools, with a
    JSON object of arguments). With no valid call the whole text stays content."""
    names = {tool.function.name for tool in tools}
    calls = []
    for body in _CALL_RE.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            continue
        if not isinstance(call, dict) or call.get("name") not in names:
            continue
        arguments = call.get("arguments", {})
        if not isinstance(arguments, dict):
            continue
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}})
    if not calls:
        return ParsedOutput(text, [])
    content = text[:text.find(CALL_OPEN)].strip()
    return ParsedOutput(content or None, calls)


def finish_reason(parsed: ParsedOutput, reason: FinishReason | None) -> str | None:
    if reason is None:
        return None
    if parsed.tool_calls and reason is not FinishReason.LENGTH:
        return "tool_calls"
    return reason.openai


def chat_message(plan: ToolPlan, text: str, reason: FinishReason | None) -> tuple[dict[str, Any], str | None]:
    """A whole chat choice's message and finish_reason under a tool plan."""
    if plan.mode is ToolMode.NONE:
        return {"role": "assistant", "content": text}, reason.openai if reason else None
    parsed = parse_output(text, plan.tools)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        message["tool_calls"] = parsed.tool_calls
    return message, finish_reason(parsed, reason)


def open_prefix_length(text: str) -> int:
    """How many trailing characters of text could still grow into CALL_OPEN (held back
    while streaming, so a tool call is never half sent as content)."""
    for size in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if CALL_OPEN.startswith(text[-size:]):
            return size
    return 0


def chat_constraint_spec(spec: ConstraintSpec | None, plan: ToolPlan) -> ConstraintSpec | None:
    """The chat request's one grammar: a response format, or a forced tool call."""
    if spec is not None and plan.spec is not None:
        raise ValidationError("a forced `tool_choice` cannot be combined with `response_format` or a constraint")
    return spec if spec is not None else plan.spec


def template_inputs(tokenizer: Any, messages: list[dict[str, Any]],
                    plan: ToolPlan) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and extra variables to render: `tools` goes to the template; a template
    that does not use it gets the Hermes tool prompt, and earlier calls as Hermes text."""
    if plan.mode is ToolMode.NONE:
        return messages, {}
    if "tools" in (tokenizer.chat_template or ""):
        return messages, {"tools": plan.template_tools}
    written = [{**m, "content": (m.get("content") or "") + calls_as_text(m["tool_calls"])} if m.get("tool_calls")
               else m for m in messages]
    return with_tools_prompt(written, plan.tools), {"tools": plan.template_tools}
