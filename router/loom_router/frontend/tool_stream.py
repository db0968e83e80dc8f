"""Streaming a chat completion that may call tools, in OpenAI's chunk shapes.

Content streams as it comes, except text that is (or could still grow into) a
`<tool_call>`: that is held until the choice finishes, then sent as tool-call deltas
(the first with id, type and name, the next with the JSON arguments) and a final chunk
with `finish_reason: "tool_calls"`, the way the official client reassembles them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from loom_router.frontend.http_common import sse
from loom_router.frontend.tools import CALL_OPEN, ToolMode, ToolPlan, finish_reason, open_prefix_length, parse_output
from loom_router.types import ChoiceEvent, GenerationError, PromptInfo

UsageFn = Callable[[PromptInfo, int], dict[str, Any]]


@dataclass(slots=True)
class _ChoiceText:
    text: str = ""
    num_sent: int = 0  # characters of text already sent as content
    in_calls: bool = False  # a <tool_call> started: hold everything from here


async def tool_chunks(reply: Any, plan: ToolPlan, n: int, stream: Any, events: AsyncIterator[list[ChoiceEvent]],
                      usage: UsageFn) -> AsyncIterator[bytes]:
    """SSE events of a tool-enabled chat stream; `reply` is openai_api's _Reply."""
    extra = {"usage": None} if reply.include_usage else {}

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        return sse({**reply.envelope("chat.completion.chunk", [choice]), **extra})

    for index in range(n):
        yield chunk(index, {"role": "assistant", "content": ""})
    texts = [_ChoiceText() for _ in range(n)]
    num_generated = 0
    try:
        async for batch in events:
            num_generated += len(batch)
            pieces: list[bytes] = []
            for event in batch:
                state = texts[event.index]
                state.text += event.text
                content = _releasable(state) if plan.mode is ToolMode.AUTO else ""
                if content:
                    pieces.append(chunk(event.index, {"content": content}))
                if event.finish_reason is not None:
                    pieces += _final_chunks(state, plan, event, chunk)
            if pieces:
                yield b"".join(pieces)
    except GenerationError as e:
        yield sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})
        return
    if reply.include_usage:
        yield sse({**reply.envelope("chat.completion.chunk", []), "usage": usage(stream.prompt, num_generated)})
    yield sse("[DONE]")


def _releasable(state: _ChoiceText) -> str:
    """Content that can no longer be part of a tool call; marks it sent."""
    if state.in_calls:
        return ""
    start = state.text.find(CALL_OPEN, state.num_sent)
    if start >= 0:
        state.in_calls = True
        end = start
    else:
        end = len(state.text) - open_prefix_length(state.text)
    content, state.num_sent = state.text[state.num_sent:end], max(end, state.num_sent)
    return content


def _final_chunks(state: _ChoiceText, plan: ToolPlan, event: ChoiceEvent,
                  chunk: Callable[..., bytes]) -> list[bytes]:
    rest = state.text[state.num_sent:]
    parsed = parse_output(rest, plan.tools)
    pieces = []
    if parsed.content:
        pieces.append(chunk(event.index, {"content": parsed.content}))
    for i, call in enumerate(parsed.tool_calls):
        function = call["function"]
        pieces.append(chunk(event.index, {"tool_calls": [
            {"index": i, "id": call["id"], "type": "function", "function": {"name": function["name"], "arguments": ""}}]}))
        pieces.append(chunk(event.index, {"tool_calls": [{"index": i, "function": {"arguments": function["arguments"]}}]}))
    pieces.append(chunk(event.index, {}, finish_reason(parsed, event.finish_reason)))
    return pieces
