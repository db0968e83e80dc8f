"""The Responses API's output: a chat answer as output items (reasoning, message, function_call),
and its stream as the typed events the official client reassembles (response.created, the
items' added / delta / done events, response.completed or response.incomplete)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from loom_router.frontend.tool_stream import Delta
from loom_router.types import FinishReason, GenerationError, PromptInfo


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or _item_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [] if status == "in_progress" else [{"type": "output_text", "text": text, "annotations": []}]}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed",
              item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or _item_id("fc"), "type": "function_call", "status": status, "call_id": call_id,
            "name": name, "arguments": arguments}


def reasoning_item(text: str, item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or _item_id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A whole chat message (tools.chat_message) as output items."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        items.append(message_item(message["content"]))
    for call in message.get("tool_calls") or []:
        items.append(call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    return items


def finished_response(head: dict[str, Any], output: list[dict[str, Any]], reason: FinishReason | None,
                      prompt: PromptInfo, num_output: int) -> dict[str, Any]:
    """The response once generated: `incomplete` when max_output_tokens cut it off, and so is the
    message or call it cut."""
    cut = reason is FinishReason.LENGTH
    if cut and output and "status" in output[-1]:
        output = [*output[:-1], {**output[-1], "status": "incomplete"}]
    num_input = prompt.num_prompt_tokens
    usage = {"input_tokens": num_input, "input_tokens_details": {"cached_tokens": prompt.num_cached_tokens},
             "output_tokens": num_output, "output_tokens_details": {"reasoning_tokens": 0},
             "total_tokens": num_input + num_output}
    return {**head, "status": "incomplete" if cut else "completed", "output": output, "usage": usage,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None}


def _sse(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: ".encode() + json.dumps(event).encode() + b"\n\n"


class ResponseEvents:
    """One streamed response: its output items opened, grown and closed as the chat deltas come.

    `on_done(response)` runs with the finished response (to store it) before the last event."""

    def __init__(self, head: dict[str, Any], prompt: PromptInfo,
                 on_done: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        self.head = head
        self.prompt = prompt  # filled in once the prompt is prefilled
        self.on_done = on_done
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # finished
        self.open: dict[str, Any] | None = None  # the item growing now
        self.text = ""  # the open item's text or arguments so far

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return _sse(payload)

    async def write(self, deltas: AsyncIterator[tuple[int, list[Delta]]]) -> AsyncIterator[bytes]:
        yield self.event("response.created", response=self.head)
        yield self.event("response.in_progress", response=self.head)
        num_tokens, reason = 0, None
        try:
            async for count, batch in deltas:
                num_tokens += count
                out: list[bytes] = []
                for delta in batch:
                    out += self._delta(delta)
                    reason = delta.reason or reason
                if out:
                    yield b"".join(out)
        except GenerationError as e:
            failed = {**self.head, "status": "failed", "error": {"code": "server_error", "message": str(e)}}
            yield self.event("response.failed", response=failed)
            return
        closing = self._close("incomplete" if reason is FinishReason.LENGTH else "completed")
        response = finished_response(self.head, self.items, reason, self.prompt, num_tokens)
        await self.on_done(response)
        final = "response.incomplete" if reason is FinishReason.LENGTH else "response.completed"
        yield b"".join(closing) + self.event(final, response=response)

    # ---- items -----------------------------------------------------------------------------

    def _delta(self, delta: Delta) -> list[bytes]:
        out: list[bytes] = []
        piece = delta.delta
        if piece.get("reasoning_content"):
            out += self._grow("reasoning", piece["reasoning_content"], lambda: reasoning_item("", None))
        if piece.get("content"):
            out += self._grow("message", piece["content"], lambda: message_item("", "in_progress"))
        for call in piece.get("tool_calls", []):
            function = call.get("function", {})
            if "id" in call:
                out += self._close()
                out += self._start(call_item(call["id"], function.get("name", ""), "", "in_progress"))
            if function.get("arguments"):
                out += self._grow("function_call", function["arguments"], None)
        return out

    def _grow(self, kind: str, text: str, new: Callable[[], dict[str, Any]] | None) -> list[bytes]:
        out: list[bytes] = []
        if (self.open is None or self.open["type"] != kind) and new is not None:
            out += self._close()
            out += self._start(new())
        assert self.open is not None
        self.text += text
        where = {"item_id": self.open["id"], "output_index": len(self.items)}
        if kind == "message":
            return out + [self.event("response.output_text.delta", **where, content_index=0, delta=text, logprobs=[])]
        if kind == "reasoning":
            return out + [self.event("response.reasoning_text.delta", **where, content_index=0, delta=text)]
        return out + [self.event("response.function_call_arguments.delta", **where, delta=text)]

    def _start(self, item: dict[str, Any]) -> list[bytes]:
        self.open, self.text = item, ""
        out = [self.event("response.output_item.added", output_index=len(self.items), item=item)]
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": []}
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=len(self.items),
                                  content_index=0, part=part))
        return out

    def _close(self, status: str = "completed") -> list[bytes]:
        """Finishes the open item (as `status`): its done events, and it joins the response's output."""
        item, text = self.open, self.text
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": len(self.items)}
        out: list[bytes] = []
        if item["type"] == "message":
            item = message_item(text, status, item["id"])
            out.append(self.event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]))
            out.append(self.event("response.content_part.done", **where, content_index=0,
                                  part=item["content"][0]))
        elif item["type"] == "reasoning":
            item = reasoning_item(text, item["id"])
            out.append(self.event("response.reasoning_text.done", **where, content_index=0, text=text))
        else:
            item = call_item(item["call_id"], item["name"], text, status, item["id"])
            out.append(self.event("response.function_call_arguments.done", **where, name=item["name"],
                                  arguments=text))
        out.append(self.event("response.output_item.done", output_index=len(self.items), item=item))
        self.items.append(item)
        self.open, self.text = None, ""
        return out
