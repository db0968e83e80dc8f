"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) on the chat path: a
request becomes a chat completion request (system, content blocks, tool_use / tool_result as
tool calls and tool messages), runs through the same template, tools, constraints and stream,
and its answer is written as Anthropic's content blocks, stop reasons and stream events."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from loom_router.frontend.api_errors import anthropic_error
from loom_router.frontend.http_common import (
    ChoiceResult,
    EventStreamResponse,
    batches,
    generate,
    get_state,
    submit,
)
from loom_router.frontend.json_body import UnicodeJSONRoute
from loom_router.frontend.openai_api import ChatJob, check_model, prepare_chat, render_chat
from loom_router.frontend.tool_stream import Delta, chat_deltas
from loom_router.frontend.tools import chat_message
from loom_router.frontend.validation import ChatCompletionRequest, Positive
from loom_router.types import FinishReason, GenerationError, ValidationError

router = APIRouter(prefix="/v1", tags=["Anthropic"], route_class=UnicodeJSONRoute)


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextBlock(_Model):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Model):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Model):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(block.text for block in self.content)
        return self.content or ""


class ThinkingBlock(_Model):
    type: Literal["thinking"]
    thinking: str


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


class Message(_Model):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class AnthropicTool(_Model):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(_Model):
    model: str
    max_tokens: Positive
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Positive | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None


class CountTokensRequest(_Model):
    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None


# ---- routes -----------------------------------------------------------------------------


@router.post("/messages", summary="Anthropic Messages: a message, streamed with Anthropic's events or whole")
async def messages_route(body: MessagesRequest, request: Request) -> Any:
    state = get_state(request)
    job = await prepare_chat(state, as_chat_request(body), check_model(state, body.model))
    if body.stream:
        stream, timer = await submit(state, job.ids, job.params)
        events = _events(body, job, chat_deltas(job.answer, 1, batches(stream, timer)))
        return EventStreamResponse(events, stream.cancel)
    generation = await generate(state, request, job.ids, job.params)
    (choice,) = generation.choices
    message, finish = chat_message(job.answer, choice.text, choice.finish_reason)
    return {**_message_head(body), "content": _content_blocks(message),
            **_stop(finish, choice.finish_reason, body.stop_sequences, _stopped_at(choice)),
            "usage": {"input_tokens": len(job.ids), "output_tokens": len(choice.tokens)}}


@router.post("/messages/count_tokens", summary="Anthropic: the input tokens a Messages request would take")
async def count_tokens_route(body: CountTokensRequest, request: Request) -> dict[str, int]:
    state = get_state(request)
    check_model(state, body.model)
    full = MessagesRequest.model_validate({**body.model_dump(exclude_none=True), "max_tokens": 1})
    ids, _, _ = await render_chat(state, as_chat_request(full))  # counted whatever its length
    return {"input_tokens": len(ids)}


# ---- the request as a chat request --------------------------------------------------------


def as_chat_request(body: MessagesRequest) -> ChatCompletionRequest:
    """Anthropic's fields in the chat request's terms. Raises RequestValidationError (422)."""
    messages: list[dict[str, Any]] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else "".join(b.text for b in body.system)
        messages.append({"role": "system", "content": system})
    _check_tool_pairs(body.messages)
    for message in body.messages:
        messages += _chat_messages(message)
    chat: dict[str, Any] = {"messages": messages, "max_tokens": body.max_tokens, "stop": body.stop_sequences,
                            "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k}
    if body.tools:
        chat["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.input_schema}} for t in body.tools]
    if body.tool_choice is not None:
        chat.update(_tool_choice(body.tool_choice))
    chat["continue_final_message"] = _is_prefill(messages[-1])
    return ChatCompletionRequest.translated(chat)


def _is_prefill(final: dict[str, Any]) -> bool:
    """A final assistant message with text: the answer goes on from it (Anthropic's prefill),
    which may not end in whitespace (as Anthropic refuses it)."""
    text = final["content"]
    if final["role"] != "assistant" or not text or final.get("tool_calls"):
        return False
    if text != text.rstrip():
        raise ValidationError("messages: final assistant content cannot end with trailing whitespace")
    return True


def _check_tool_pairs(messages: list[Message]) -> None:
    """As Anthropic's API: every tool_use is answered by a tool_result in the next message, and
    every tool_result answers a tool_use of the message before. Raises ValidationError."""
    asked: set[str] = set()
    for i, message in enumerate(messages):
        blocks = message.content if isinstance(message.content, list) else []
        answered = {b.tool_use_id for b in blocks if isinstance(b, ToolResultBlock)}
        if answered - asked:
            raise ValidationError(f"messages.{i}: tool_result block(s) for {sorted(answered - asked)} answer no "
                                  "tool_use block of the previous message")
        if asked - answered:
            raise ValidationError(f"messages.{i}: tool_use ids {sorted(asked - answered)} have no tool_result "
                                  "block in the message after them")
        asked = {b.id for b in blocks if isinstance(b, ToolUseBlock)}


def _chat_messages(message: Message) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: tool results become tool messages (before the
    user's text, as they answer the turn before), tool_use blocks an assistant's tool_calls."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    text = "".join(b.text for b in message.content if isinstance(b, TextBlock))
    results = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text}
               for b in message.content if isinstance(b, ToolResultBlock)]
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
             for b in message.content if isinstance(b, ToolUseBlock)]
    out: list[dict[str, Any]] = results
    if text or not (results or calls):
        out = out + [{"role": message.role, "content": text}]
    if calls:
        if out and out[-1]["role"] == "assistant":
            out[-1]["tool_calls"] = calls
        else:
            out = out + [{"role": "assistant", "content": None, "tool_calls": calls}]
    return out


def _tool_choice(choice: ToolChoice) -> dict[str, Any]:
    fields: dict[str, Any] = {"parallel_tool_calls": False} if choice.disable_parallel_tool_use else {}
    if choice.type == "tool":
        return {**fields, "tool_choice": {"type": "function", "function": {"name": choice.name or ""}}}
    return {**fields, "tool_choice": {"auto": "auto", "any": "required", "none": "none"}[choice.type]}


# ---- the answer -------------------------------------------------------------------------


def _message_head(body: MessagesRequest) -> dict[str, Any]:
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": body.model}


def _content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        blocks.append({"type": "tool_use", "id": _tool_use_id(call["id"]), "name": call["function"]["name"],
                       "input": _input(call["function"]["arguments"])})
    return blocks


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as an object; {} for a call cut off before its arguments closed."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _stopped_at(choice: ChoiceResult) -> str:
    """What the choice's tokens wrote past its text: a stop sequence's start when one ended it."""
    return "".join(token.text for token in choice.tokens)[len(choice.text):]


def _stop(finish: str | None, reason: FinishReason | None, stops: list[str] | None, tail: str) -> dict[str, Any]:
    """Anthropic's stop_reason (and the stop sequence that matched) from the chat's finish."""
    if finish == "tool_calls":
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if reason is FinishReason.LENGTH:
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if reason is FinishReason.STOP:
        stops = [s for s in stops or [] if s]
        matched = next((s for s in stops if tail.startswith(s)), stops[0] if len(stops) == 1 else None)
        return {"stop_reason": "stop_sequence", "stop_sequence": matched}
    return {"stop_reason": "end_turn", "stop_sequence": None}


# ---- streaming --------------------------------------------------------------------------


def _event(name: str, payload: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: ".encode() + json.dumps(payload).encode() + b"\n\n"


class _Blocks:
    """The content blocks of a streamed message, opened and closed as its deltas arrive."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None  # the open block's type

    def open(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self.close()
        self.index += 1
        self.kind = kind
        return out + [_event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                     "content_block": block})]

    def close(self) -> list[bytes]:
        if self.kind is None:
            return []
        self.kind = None
        return [_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def delta(self, kind: str, block: dict[str, Any], delta: dict[str, Any]) -> list[bytes]:
        out = self.open(kind, block) if self.kind != kind else []
        return out + [_event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                     "delta": delta})]

    def write(self, delta: Delta) -> list[bytes]:
        out: list[bytes] = []
        if delta.delta.get("reasoning_content"):
            out += self.delta("thinking", {"type": "thinking", "thinking": "", "signature": ""},
                              {"type": "thinking_delta", "thinking": delta.delta["reasoning_content"]})
        if delta.delta.get("content"):
            out += self.delta("text", {"type": "text", "text": ""},
                              {"type": "text_delta", "text": delta.delta["content"]})
        for call in delta.delta.get("tool_calls", []):
            function = call.get("function", {})
            if "id" in call:
                out += self.open("tool_use", {"type": "tool_use", "id": _tool_use_id(call["id"]),
                                              "name": function.get("name", ""), "input": {}})
            if function.get("arguments"):
                out += self.delta("tool_use", {}, {"type": "input_json_delta", "partial_json": function["arguments"]})
        return out


async def _events(body: MessagesRequest, job: ChatJob,
                  deltas: AsyncIterator[tuple[int, list[Delta]]]) -> AsyncIterator[bytes]:
    """Anthropic's stream: message_start, a ping (as Anthropic's API sends one), content blocks
    (start, deltas, stop), message_delta with the stop reason and usage, message_stop; an `error`
    event when the generation fails."""
    head = {**_message_head(body), "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": len(job.ids), "output_tokens": 0}}
    yield _event("message_start", {"type": "message_start", "message": head}) + _event("ping", {"type": "ping"})
    blocks, num_tokens = _Blocks(), 0
    stop: dict[str, Any] = {"stop_reason": "end_turn", "stop_sequence": None}
    try:
        async for count, batch in deltas:
            num_tokens += count
            out: list[bytes] = []
            for delta in batch:
                out += blocks.write(delta)
                if delta.finish is not None:
                    stop = _stop(delta.finish, delta.reason, body.stop_sequences, "")
            if out:
                yield b"".join(out)
    except GenerationError as e:
        yield _event("error", anthropic_error(500, str(e)))
        return
    yield b"".join(blocks.close())
    yield _event("message_delta", {"type": "message_delta", "delta": stop, "usage": {"output_tokens": num_tokens}})
    yield _event("message_stop", {"type": "message_stop"})

