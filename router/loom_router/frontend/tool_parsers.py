"""Tool calls in each model family's own format, chosen from its chat template:

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>      Qwen2.5/3, Hermes, SmolLM
    llama3_json  {"name": ..., "parameters": {...}}  (the whole answer; ";" between calls,
                 after <|python_tag|> at times)                                 Llama 3.1-3.3
    mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]  or
                 [TOOL_CALLS]name[ARGS]{...}                                     Mistral, Mixtral

Each parses a whole answer into content and calls (only to known tools, with a JSON object of
arguments; anything else stays content), says where calls begin in a stream (and how much of its
tail could still begin one, held back), and writes the grammar that forces calls
(`tool_choice` required or named): Hermes and Llama 3 in their own syntax, Mistral as the bare JSON
array its parser also takes (`[TOOL_CALLS]` is a control token a grammar does not write).
"""

from __future__ import annotations

import enum
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from loom_router.structured.spec import JSON_LAYOUT, ConstraintKind, ConstraintSpec, nested_schema, strict_schema

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
_HERMES_RE = re.compile(re.escape(HERMES_OPEN) + r"\s*(.*?)\s*" + re.escape(HERMES_CLOSE), re.DOTALL)


class ToolFormat(enum.Enum):
    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"
    MISTRAL = "mistral"


def tool_format(chat_template: str | None) -> ToolFormat:
    """The format the model's template teaches; Hermes when it says nothing of tools."""
    template = chat_template or ""
    if MISTRAL_CALLS in template:
        return ToolFormat.MISTRAL
    if HERMES_OPEN in template:
        return ToolFormat.HERMES
    if PYTHON_TAG in template or ('"parameters"' in template and "ipython" in template):
        return ToolFormat.LLAMA3_JSON
    return ToolFormat.HERMES


@dataclass(slots=True)
class ParsedOutput:
    content: str | None
    tool_calls: list[dict[str, Any]]  # OpenAI's message.tool_calls entries


def parse(fmt: ToolFormat, text: str, names: set[str], cut_off: bool = False) -> ParsedOutput:
    """Split an answer into content and calls to the tools named `names`. With `cut_off` (the
    answer ended at max_tokens) a call left open is returned as it stands, a partial call with its
    arguments as far as written, once its name is complete (one cut off before is dropped, with
    its marker: never markup of a call in the content). Text that is no call (a marker in prose,
    a call to no known tool) stays content."""
    if fmt is ToolFormat.HERMES:
        calls = [c for body in _HERMES_RE.findall(text) if (c := _call(_json(body), "arguments", names))]
        start = text.find(HERMES_OPEN)
        last = text.rfind(HERMES_OPEN)
        if cut_off and last >= 0 and HERMES_CLOSE not in text[last:]:
            calls += _partial_call(text[last + len(HERMES_OPEN):], names)
    elif fmt is ToolFormat.LLAMA3_JSON:
        calls, start = _llama3_calls(text, names), 0
    else:
        calls, start = _mistral_calls(text, names)
    if calls:
        return ParsedOutput(text[:start].strip() or None, calls)
    if not cut_off:
        return ParsedOutput(text, [])
    begun = _open_call(fmt, text, names)
    if begun is not None:
        return ParsedOutput(text[:begun].strip() or None, _partial_call(text[begun:], names))
    held = held_tail(fmt, text)
    return ParsedOutput((text[: len(text) - held].rstrip() or None) if held else text, [])


def _open_call(fmt: ToolFormat, text: str, names: set[str]) -> int | None:
    """Where a call the answer was cut off writing begins; None where none is open. A Hermes
    marker opens one only when the JSON of a call to a known tool may follow it."""
    if fmt is not ToolFormat.HERMES:
        return call_start(fmt, text)
    last = text.rfind(HERMES_OPEN)
    if last < 0 or HERMES_CLOSE in text[last:]:
        return None
    body = text[last + len(HERMES_OPEN):].lstrip()
    if body and not body.startswith("{"):
        return None
    name = _FIRST_NAME.match(body)  # a call's object names its tool first
    return None if name is not None and name.group(1) not in names else last


_PARTIAL_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_FIRST_NAME = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_PARTIAL_ARGUMENTS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


def _partial_call(body: str, names: set[str]) -> list[dict[str, Any]]:
    """A call cut off while written, with its arguments' JSON so far; none before its name is
    complete (a name must be one of the tools')."""
    name = _PARTIAL_NAME.search(body)
    if name is None or name.group(1) not in names:
        return []
    arguments = _PARTIAL_ARGUMENTS.search(body)
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": name.group(1), "arguments": body[arguments.end():] if arguments else ""}}]


def call_start(fmt: ToolFormat, text: str) -> int | None:
    """Where tool calls begin in a (partial) answer; None while none began."""
    if fmt is ToolFormat.HERMES:
        at = text.find(HERMES_OPEN)
    elif fmt is ToolFormat.MISTRAL:
        at = text.find(MISTRAL_CALLS)
    else:
        stripped = text.lstrip()
        at = 0 if stripped.startswith(("{", "[", PYTHON_TAG)) else -1
    return None if at < 0 else at


def held_tail(fmt: ToolFormat, text: str) -> int:
    """How many trailing characters of text could still grow into the start of a call (held
    back while streaming, so a call is never half sent as content)."""
    if fmt is ToolFormat.LLAMA3_JSON:
        stripped = text.lstrip()
        return len(text) if stripped and PYTHON_TAG.startswith(stripped) else 0
    marker = HERMES_OPEN if fmt is ToolFormat.HERMES else MISTRAL_CALLS
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def grammar(fmt: ToolFormat, schemas: list[tuple[str, dict[str, Any]]], parallel: bool) -> ConstraintSpec:
    """A Lark grammar forcing calls (one, or several when parallel) whose JSON matches a tool:
    schemas lists (name, parameters schema); the arguments admit only the keys a schema lists
    (`strict_schema`), as OpenAI's strict function calling."""
    key = "parameters" if fmt is ToolFormat.LLAMA3_JSON else "arguments"
    defs: dict[str, Any] = {}
    variants = [{"type": "object", "properties": {"name": {"const": name}, key: nested_schema(strict_schema(params),
                                                                                             f"tool{i}_", defs)},
                 "required": ["name", key], "additionalProperties": False} for i, (name, params) in enumerate(schemas)]
    schema: dict[str, Any] = variants[0] if len(variants) == 1 else {"anyOf": variants}
    if defs:
        schema = {**schema, "$defs": defs}
    call_json = f"%json {json.dumps({**schema, 'x-guidance': JSON_LAYOUT})}"
    if fmt is ToolFormat.HERMES:
        call = f"call: {json.dumps(HERMES_OPEN + chr(10))} {call_json} {json.dumps(chr(10) + HERMES_CLOSE)}"
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
    elif fmt is ToolFormat.LLAMA3_JSON:
        call = f"call: {call_json}"
        start = 'start: call ("; " call)*' if parallel else "start: call"
    else:
        call = f"call: {call_json}"
        start = 'start: "[" call (", " call)* "]"' if parallel else 'start: "[" call "]"'
    return ConstraintSpec(ConstraintKind.LARK, f"{start}\n{call}\n")


def calls_as_text(fmt: ToolFormat, tool_calls: list[dict[str, Any]]) -> str:
    """An earlier assistant turn's tool calls written back in the format (for templates that do
    not render `tool_calls`)."""
    calls = [(c.get("function") or {}).get("name") for c in tool_calls]
    arguments = [_arguments(c) for c in tool_calls]
    if fmt is ToolFormat.HERMES:
        return "\n".join(f"{HERMES_OPEN}\n{json.dumps({'name': n, 'arguments': a})}\n{HERMES_CLOSE}"
                         for n, a in zip(calls, arguments))
    if fmt is ToolFormat.LLAMA3_JSON:
        return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in zip(calls, arguments))
    return MISTRAL_CALLS + json.dumps([{"name": n, "arguments": a} for n, a in zip(calls, arguments)])


def _arguments(tool_call: dict[str, Any]) -> Any:
    arguments = (tool_call.get("function") or {}).get("arguments") or "{}"
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _call(value: Any, key: str, names: set[str]) -> dict[str, Any] | None:
    """An OpenAI tool_calls entry from a parsed {"name", key: {...}}, or None."""
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get(key, value.get("arguments", {}))
    if not isinstance(arguments, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": value["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _llama3_calls(text: str, names: set[str]) -> list[dict[str, Any]]:
    """The whole answer as calls ({...}, [{...}, ...] or {...}; {...}), or none."""
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    parsed = _json(body)
    values = parsed if isinstance(parsed, list) else [parsed] if parsed is not None else [
        _json(part) for part in body.split(";")]
    calls = [_call(v, "parameters", names) for v in values]
    return calls if calls and all(calls) else []  # type: ignore[return-value]


def _mistral_calls(text: str, names: set[str]) -> tuple[list[dict[str, Any]], int]:
    """Calls after [TOOL_CALLS] (a JSON array, or name[ARGS]{...} each), or a bare array."""
    start = text.find(MISTRAL_CALLS)
    if start < 0:
        array = _json(text.strip())
        if isinstance(array, list):
            calls = [_call(v, "arguments", names) for v in array]
            return (calls, 0) if calls and all(calls) else ([], 0)  # type: ignore[return-value]
        return [], 0
    calls: list[dict[str, Any] | None] = []
    for part in text[start:].split(MISTRAL_CALLS)[1:]:
        part = part.strip()
        if MISTRAL_ARGS in part:
            name, _, arguments = part.partition(MISTRAL_ARGS)
            calls.append(_call({"name": name.strip(), "arguments": _json(arguments)}, "arguments", names))
        else:
            array = _json(part)
            calls.extend(_call(v, "arguments", names) for v in (array if isinstance(array, list) else [array]))
    return ([c for c in calls if c] if calls and all(calls) else []), start
