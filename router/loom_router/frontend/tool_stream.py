"""Streaming a chat completion that may call tools or reason, in OpenAI's chunk shapes.

Thinking streams as `reasoning_content` deltas (the tags never sent). Content streams as it comes,
except text that is (or could still grow into) the start of a tool call in the model's format:
that is held until the choice finishes, then sent as tool-call deltas (the first with id, type and
name, the next with the JSON arguments) and a final chunk with `finish_reason: "tool_calls"`, the
way the official client reassembles them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from loom_router.frontend import tool_parsers
from loom_router.frontend.http_common import sse
from loom_router.frontend.reasoning import Part, PartStream
from loom_router.frontend.tools import AnswerFormat, ToolMode, ToolPlan, finish_reason, parse_output
from loom_router.types import ChoiceEvent, FinishReason, GenerationError, PromptInfo

UsageFn = Callable[[PromptInfo, int], dict[str, Any]]


@dataclass(slots=True, frozen=True)
class Delta:
    """One piece of a chat choice, in OpenAI's chunk terms: a `delta` and maybe its finish_reason."""

    index: int
    delta: dict[str, Any]
    finish: str | None = None
    reason: FinishReason | None = None  # why the choice finished (with `finish`)


@dataclass(slots=True)
class _ChoiceText:
    reasoning: PartStream | None
    text: str = ""  # the content so far
    num_sent: int = 0  # characters of text already sent as content
    in_calls: bool = False  # a tool call started: hold everything from here


async def chat_deltas(answer: AnswerFormat | ToolPlan, n: int,
                      events: AsyncIterator[list[ChoiceEvent]]) -> AsyncIterator[tuple[int, list[Delta]]]:
    """A chat stream's pieces (content, reasoning, tool calls, finish), read in the answer's
    format: per batch of events, (number of tokens, deltas). Raises the stream's GenerationError.
    The OpenAI chunks below and the other APIs' events (Responses, Anthropic) are written from these."""
    if isinstance(answer, ToolPlan):
        answer = AnswerFormat(answer)
    texts = [_ChoiceText(answer.reasoning_stream()) for _ in range(n)]
    async for batch in events:
        yield len(batch), [d for event in batch for d in _event_deltas(texts[event.index], answer.tools, event)]


async def tool_chunks(reply: Any, answer: AnswerFormat | ToolPlan, n: int, stream: Any,
                      events: AsyncIterator[list[ChoiceEvent]], usage: UsageFn) -> AsyncIterator[bytes]:
    """SSE events of a chat stream with tools or reasoning; `reply` is openai_api's Reply."""
    extra = {"usage": None} if reply.include_usage else {}

    def chunk(delta: Delta) -> bytes:
        choice = {"index": delta.index, "delta": delta.delta, "logprobs": None, "finish_reason": delta.finish}
        return sse({**reply.envelope("chat.completion.chunk", [choice]), **extra})

    for index in range(n):
        yield chunk(Delta(index, {"role": "assistant", "content": ""}))
    num_generated = 0
    try:
        async for num_tokens, deltas in chat_deltas(answer, n, events):
            num_generated += num_tokens
            if deltas:
                yield b"".join(chunk(delta) for delta in deltas)
    except GenerationError as e:
        yield sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})
        return
    if reply.include_usage:
        yield sse({**reply.envelope("chat.completion.chunk", []), "usage": usage(stream.prompt, num_generated)})
    yield sse("[DONE]")


def _event_deltas(state: _ChoiceText, plan: ToolPlan, event: ChoiceEvent) -> list[Delta]:
    pieces = [(Part.CONTENT, event.text)] if state.reasoning is None else state.reasoning.feed(event.text)
    if event.finish_reason is not None and state.reasoning is not None:
        pieces += state.reasoning.finish()
    out = []
    for part, text in pieces:
        if part is Part.REASONING:
            out.append(Delta(event.index, {"reasoning_content": text}))
            continue
        state.text += text
        content = _releasable(state, plan) if plan.mode is not ToolMode.FORCED else ""
        if content:
            out.append(Delta(event.index, {"content": content}))
    if event.finish_reason is not None:
        out += _final_deltas(state, plan, event.index, event.finish_reason)
    return out


def _releasable(state: _ChoiceText, plan: ToolPlan) -> str:
    """Content that can no longer be part of a tool call; marks it sent."""
    if state.in_calls:
        return ""
    if plan.mode is ToolMode.NONE:
        end = len(state.text)
    else:
        start = tool_parsers.call_start(plan.format, state.text[state.num_sent :])
        if start is not None:
            state.in_calls = True
            end = state.num_sent + start
        else:
            end = len(state.text) - tool_parsers.held_tail(plan.format, state.text)
    content, state.num_sent = state.text[state.num_sent : end], max(end, state.num_sent)
    return content


def _final_deltas(state: _ChoiceText, plan: ToolPlan, index: int, reason: FinishReason) -> list[Delta]:
    rest = state.text[state.num_sent :]
    if plan.mode is ToolMode.NONE:
        pieces = [Delta(index, {"content": rest})] if rest else []
        return pieces + [Delta(index, {}, reason.openai, reason)]
    parsed = parse_output(rest, plan, reason)
    pieces = []
    if parsed.content:
        pieces.append(Delta(index, {"content": parsed.content}))
    for i, call in enumerate(parsed.tool_calls):
        function = call["function"]
        pieces.append(Delta(index, {"tool_calls": [
            {"index": i, "id": call["id"], "type": "function", "function": {"name": function["name"], "arguments": ""}}]}))
        pieces.append(Delta(index, {"tool_calls": [{"index": i, "function": {"arguments": function["arguments"]}}]}))
    pieces.append(Delta(index, {}, finish_reason(parsed, reason), reason))
    return pieces
