"""OpenAI's Responses API (POST /v1/responses, GET and DELETE /v1/responses/{id}) on the chat
path: `instructions` and `input` (a string, or items: messages, function calls and their
outputs) become chat messages, `tools` and `text.format` the chat request's tools and response
format; the answer is written as output items (message, function_call, reasoning). Stored
responses (`store`, default true) live in the engine core's bounded store, so
`previous_response_id` continues a conversation from any frontend."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Annotated, Any, Literal

import orjson
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from loom_router.frontend.http_common import AppState, EventStreamResponse, batches, generate, get_state, submit
from loom_router.frontend.json_body import UnicodeJSONRoute
from loom_router.frontend.openai_api import check_model, prepare_chat
from loom_router.frontend.responses_stream import ResponseEvents, finished_response, output_items
from loom_router.frontend.tool_stream import chat_deltas
from loom_router.frontend.tools import chat_message
from loom_router.frontend.validation import ChatCompletionRequest, Positive, Seed
from loom_router.types import APIError, GenerationError, ValidationError

log = logging.getLogger("loom.responses")
router = APIRouter(prefix="/v1", tags=["OpenAI Responses"], route_class=UnicodeJSONRoute)


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Model):
    format: TextFormat | None = None


class FunctionTool(_Model):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Model):
    type: Literal["function"]
    name: str


class ResponsesRequest(_Model):
    model: str | None = None
    input: Annotated[str, Field(min_length=1)] | Annotated[list[dict[str, Any]], Field(min_length=1)]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: Positive | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    seed: Seed | None = None  # Loom's extension, as on chat
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None


# ---- routes -----------------------------------------------------------------------------


@router.post("/responses", summary="Create a response (streamed with the Responses API's events, or whole)")
async def create_route(body: ResponsesRequest, request: Request) -> Any:
    state = get_state(request)
    adapter = check_model(state, body.model)
    history = await _history(state, body.previous_response_id)
    conversation = history + input_messages(body.input)
    job = await prepare_chat(state, as_chat_request(body, conversation), adapter, field="input")
    head = _response_head(state, body)
    if body.stream:
        stream, timer = await submit(state, job.ids, job.params)
        events = ResponseEvents(head, stream.prompt, lambda response: _store(state, body, conversation, response))
        return EventStreamResponse(events.write(chat_deltas(job.answer, 1, batches(stream, timer))), stream.cancel)
    generation = await generate(state, request, job.ids, job.params)
    (choice,) = generation.choices
    message, _ = chat_message(job.answer, choice.text, choice.finish_reason)
    response = finished_response(head, output_items(message), choice.finish_reason, generation.prompt,
                                 len(choice.tokens))
    await _store(state, body, conversation, response)
    return response


@router.get("/responses/{response_id}", summary="A stored response")
async def get_route(response_id: str, request: Request) -> dict[str, Any]:
    return (await _record(get_state(request), response_id))["response"]


@router.delete("/responses/{response_id}", summary="Delete a stored response")
async def delete_route(response_id: str, request: Request) -> dict[str, Any]:
    if not await get_state(request).engine.call("response_delete", response_id, timeout_s=10.0):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


# ---- the request as a chat request --------------------------------------------------------


def as_chat_request(body: ResponsesRequest, conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request a Responses request runs as (instructions first, never carried over)."""
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    chat: dict[str, Any] = {"messages": system + conversation, "max_tokens": body.max_output_tokens,
                            "temperature": body.temperature, "top_p": body.top_p, "seed": body.seed,
                            "parallel_tool_calls": body.parallel_tool_calls}
    if body.tools:
        chat["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                         for tool in body.tools]
    if isinstance(body.tool_choice, NamedFunction):
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name, "schema": fmt.json_schema, "strict": fmt.strict}}
    elif fmt is not None:
        chat["response_format"] = {"type": fmt.type}
    return ChatCompletionRequest.translated(chat)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as chat messages: a string is one user message; function calls join the assistant
    turn before them, their outputs become tool messages. Raises ValidationError (422)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": _role(item, i), "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", i), "type": "function",
                    "function": {"name": _string(item, "name", i), "arguments": _string(item, "arguments", i)}}
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": None})
            messages[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", i),
                             "content": _text(item.get("output"), i)})
        elif kind != "reasoning":  # a model's own reasoning is not sent back to it
            raise ValidationError(f"`input[{i}]`: items of type {kind!r} are not supported")
    return messages


def _role(item: dict[str, Any], index: int) -> str:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise ValidationError(f"`input[{index}].role` must be user, assistant, system or developer. Given: {role!r}")
    return role


def _string(item: dict[str, Any], key: str, index: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ValidationError(f"`input[{index}].{key}` must be a string")
    return value


def _text(content: Any, index: int) -> str:
    """A message's content: a string or text parts (input_text, output_text, text)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
        return "".join(part["text"] for part in content)
    raise ValidationError(f"`input[{index}]`: content must be a string or a list of text parts")


# ---- the answer -------------------------------------------------------------------------


def _response_head(state: AppState, body: ResponsesRequest) -> dict[str, Any]:
    """The response object before its output: what the request asked for."""
    fmt = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format else None
    tool_choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedFunction) else body.tool_choice
    return {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "model": state.model_name, "output": [], "error": None,
            "incomplete_details": None, "instructions": body.instructions, "metadata": body.metadata or {},
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "tool_choice": tool_choice or "auto", "parallel_tool_calls": body.parallel_tool_calls is not False,
            "temperature": body.temperature, "top_p": body.top_p, "max_output_tokens": body.max_output_tokens,
            "previous_response_id": body.previous_response_id, "store": body.store,
            "text": {"format": fmt or {"type": "text"}}, "usage": None}


# ---- the store --------------------------------------------------------------------------


async def _store(state: AppState, body: ResponsesRequest, conversation: list[dict[str, Any]],
                 response: dict[str, Any]) -> None:
    """Keeps the response (and the conversation it continues) unless `store` is false. A failure
    to store is logged: the answer still goes out (a later GET of it is a 404)."""
    if not body.store:
        return
    record = {"response": response, "conversation": conversation + _as_messages(response["output"])}
    try:
        await state.engine.call("response_put", response["id"], timeout_s=10.0, payload=orjson.dumps(record))
    except (GenerationError, TimeoutError) as error:
        log.warning("response %s not stored: %s", response["id"], error)


async def _record(state: AppState, response_id: str) -> dict[str, Any]:
    record = await state.engine.call("response_get", response_id, timeout_s=10.0)
    if record is None:
        raise _not_found(response_id)
    return orjson.loads(record)


async def _history(state: AppState, previous_response_id: str | None) -> list[dict[str, Any]]:
    """The conversation a previous response ended (its input and output, not its instructions)."""
    if previous_response_id is None:
        return []
    return (await _record(state, previous_response_id))["conversation"]


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"No response found with id '{response_id}'.", "not_found", "response_id")


def _as_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages that continue from it."""
    return input_messages(output) if output else []
