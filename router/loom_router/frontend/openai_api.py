"""OpenAI-compatible routes: /v1/chat/completions (with the model's chat template) and /v1/models,
streaming or not, in the shapes the official `openai` client reads; and what the other /v1 APIs
share: the chat path (`prepare_chat`), `model` and context checks, OpenAI's errors and chunks."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from loom_router.frontend.http_common import (
    INLINE_CHARS,
    AppState,
    ChoiceResult,
    EventStreamResponse,
    Generation,
    batches,
    check_input_chars,
    encode,
    generate,
    get_state,
    off_the_loop_if,
    sse,
    submit,
)
from loom_router.frontend.json_body import UnicodeJSONRoute
from loom_router.frontend.lora_routes import adapter_models
from loom_router.frontend.text import token_string
from loom_router.frontend.tool_stream import tool_chunks
from loom_router.frontend.tools import (
    AnswerFormat,
    ToolMode,
    ToolPlan,
    answer_format,
    chat_constraint_spec,
    chat_message,
    plan_tools,
    template_inputs,
    tool_format_of,
)
from loom_router.frontend.validation import (
    ChatCompletionRequest,
    check_openai,
    openai_generation_params,
)
from loom_router.types import (
    APIError,
    ChoiceEvent,
    GeneratedToken,
    GenerationError,
    GenerationParams,
    PromptInfo,
)

SYSTEM_FINGERPRINT = "loom"
MARK = "\ue000loom-choice\ue000"  # stands for a chunk's choice while its framing is cut out
ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 422: "invalid_request_error",
               429: "rate_limit_error", 424: "server_error", 503: "server_error"}

NAMED_FIELD = re.compile(r"(?:Value error, )?`([a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)*)`")

router = APIRouter(prefix="/v1", tags=["OpenAI"], route_class=UnicodeJSONRoute)


def is_openai_path(path: str) -> bool:
    return path.startswith("/v1/")


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    """OpenAI's error body; `param` defaults to the field a message starts by naming (`n` ...)."""
    if param is None and (named := NAMED_FIELD.match(message.removeprefix("Input validation error: "))):
        param = named.group(1)
    error = {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
             "param": param, "code": code}
    return JSONResponse({"error": error}, status_code=status)


def check_model(state: AppState, model: str | None) -> str | None:
    """The LoRA adapter `model` names, or None for the served model (also when none is named).
    With adapters on, another name is an adapter's, which the engine core resolves (404 when no
    adapter has it); else an unknown `model` is OpenAI's 404 model_not_found."""
    if model is None or model in state.model_names:
        return None
    if state.config.enable_lora:
        return model
    raise APIError(404, f"The model `{model}` does not exist.", "model_not_found", "model")


def check_context(state: AppState, num_input_tokens: int, max_tokens: int | None, field: str = "messages") -> None:
    """A prompt (with max_tokens) past the context is OpenAI's 400 context_length_exceeded, whose
    `param` is the request's `field` that holds the prompt."""
    context = state.engine.max_total_tokens
    requested = num_input_tokens + (max_tokens or 0)
    if num_input_tokens > state.engine.max_input_tokens or requested > context:
        raise APIError(400, f"This model's maximum context length is {context} tokens. However, you requested "
                       f"{requested} tokens ({num_input_tokens} in the prompt, {max_tokens or 0} for the "
                       f"completion; at most {state.engine.max_input_tokens} prompt tokens). Please reduce the "
                       "length of the prompt or of the completion.", "context_length_exceeded", field)


@dataclass(slots=True, frozen=True)
class Echo:
    """A completion's prompt, written back before its text (`echo`)."""

    ids: list[int]
    texts: list[str]  # the text each prompt token adds

    @property
    def text(self) -> str:
        return "".join(self.texts)


@dataclass(slots=True)
class Reply:
    """What every response of one request shares."""

    kind: str  # "chat" or "text"
    model: str
    logprobs: bool
    include_usage: bool
    n: int = 1  # choices per prompt
    echoes: list[Echo] = field(default_factory=list)  # completions with echo: one per prompt
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def echo(self, index: int) -> Echo | None:
        """The echoed prompt of choice `index` (prompt index * n + choice), if any."""
        return self.echoes[index // self.n] if self.echoes else None

    def envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
        return {"id": f"{prefix}-{self.id}", "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": SYSTEM_FINGERPRINT, "choices": choices}

    def chunk_framing(self, obj: str, extra: dict[str, Any]) -> tuple[bytes, bytes]:
        """The SSE bytes before and after a chunk's one choice (`sse({**envelope(obj, [choice]),
        **extra})` is prefix + choice's JSON + suffix), written once per stream, not per token."""
        whole = sse({**self.envelope(obj, [MARK]), **extra})
        prefix, _, suffix = whole.partition(orjson.dumps(MARK))
        return prefix, suffix


# ---- routes -----------------------------------------------------------------------------


@router.get("/models", summary="The served model")
async def models_route(request: Request) -> dict[str, Any]:
    state = get_state(request)
    return {"object": "list", "data": [_model_card(state), *await adapter_models(state)]}


@router.get("/models/{model_id:path}", summary="The served model, by name (404 model_not_found for others)")
async def model_route(model_id: str, request: Request) -> dict[str, Any]:
    state = get_state(request)
    if check_model(state, model_id) is None:
        return _model_card(state)
    cards = [card for card in await adapter_models(state) if card["id"] == model_id]
    if not cards:
        raise APIError(404, f"The model `{model_id}` does not exist.", "model_not_found", "model")
    return cards[0]


def _model_card(state: AppState) -> dict[str, Any]:
    return {"id": state.model_name, "object": "model", "created": 0, "owned_by": "loom",
            "root": state.config.model_id, "parent": None, "max_model_len": state.engine.max_total_tokens}


@router.post("/chat/completions", summary="Chat completion with the model's chat template")
async def chat_route(body: ChatCompletionRequest, request: Request) -> Any:
    state = get_state(request)
    adapter = check_model(state, body.model)
    job = await prepare_chat(state, body, adapter)
    reply = Reply("chat", adapter or state.model_name, body.logprobs, body.include_usage)
    if body.stream:
        return await _stream(state, reply, job.ids, job.params, job.answer)
    generation = await generate(state, request, job.ids, job.params)
    choices = []
    for c in generation.choices:
        message, finish = chat_message(job.answer, c.text, c.finish_reason)
        choices.append({
            "index": c.index,
            "message": message,
            "logprobs": {"content": [_chat_logprob(state, t) for t in c.tokens]} if reply.logprobs else None,
            "finish_reason": finish,
        })
    return {**reply.envelope("chat.completion", choices), "usage": _usage(generation.prompt, generation)}


@dataclass(slots=True)
class ChatJob:
    """A chat request made ready to run: its prompt ids, parameters and how to read its answer
    (shared by the chat, Responses and Anthropic Messages routes)."""

    ids: list[int]
    params: GenerationParams
    answer: AnswerFormat


async def prepare_chat(state: AppState, body: ChatCompletionRequest, adapter: str | None = None,
                       field: str = "messages") -> ChatJob:
    """Validates a chat request (for the base model or a LoRA adapter), renders its template
    (tools, reasoning) and tokenizes it. Raises ValidationError (422) or APIError
    (context_length_exceeded); both name `field`, the request's own name for the messages."""
    limits = state.limits()
    check_openai(body, limits)
    ids, prompt, tool_plan = await render_chat(state, body, field)
    check_context(state, len(ids), body.requested_max_tokens, field)
    max_new_tokens = state.engine.validate_lengths(len(ids), body.requested_max_tokens, body.n)
    params = openai_generation_params(body, max_new_tokens, limits)
    params.constraint = chat_constraint_spec(body.constraint_spec(), tool_plan)
    answer = answer_format(tool_plan, state.tokenizer.chat_template, prompt)
    params.skip_special_tokens = not answer.keeps_special_tokens
    params.adapter = adapter
    return ChatJob(ids, params, answer)


async def render_chat(state: AppState, body: ChatCompletionRequest,
                      field: str = "messages") -> tuple[list[int], str, ToolPlan]:
    """The chat request's prompt through the model's template (tools, reasoning), its token ids
    and the tool plan; whatever its length (the context is the caller's to check)."""
    tool_plan = plan_tools(body, tool_format_of(state.tokenizer.chat_template))
    messages, extra = template_inputs(state.tokenizer, [m.as_template_message() for m in body.messages], tool_plan)
    num_chars = sum(len(str(m.get("content") or "")) for m in messages)
    check_input_chars(state, num_chars, field)
    extra = {**body.template_variables, **extra}  # vLLM's: e.g. Qwen3's enable_thinking
    long = num_chars > INLINE_CHARS or "tools" in extra  # tools: their JSON schemas are rendered too
    prompt = await off_the_loop_if(long, state.tokenizer.apply_chat_template, messages, body.adds_generation_prompt,
                                   body.continues_final_message, extra)
    ids = await encode(state, prompt, add_special_tokens=False, field=field)  # the template wrote the specials
    return ids, prompt, tool_plan


# ---- streaming --------------------------------------------------------------------------


async def _stream(state: AppState, reply: Reply, ids: list[int], params: GenerationParams,
                  answer: AnswerFormat) -> Response:
    stream, timer = await submit(state, ids, params)
    if answer.tools.mode is not ToolMode.NONE or answer.reasoning is not None:
        chunks = tool_chunks(reply, answer, params.n, stream, batches(stream, timer), usage_counts)
        return EventStreamResponse(chunks, stream.cancel)

    def opening(index: int) -> dict[str, Any]:  # OpenAI opens every chat choice with the role
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    chunks = stream_chunks(reply, params.n, stream, batches(stream, timer), opening,
                           lambda one: _chat_chunk_choice(state, reply, one))
    return EventStreamResponse(chunks, stream.cancel)


async def stream_chunks(reply: Reply, n: int, stream: Any, events: AsyncIterator[list[ChoiceEvent]],
                        opening: Callable[[int], dict[str, Any] | None],
                        choice: Callable[[ChoiceResult], dict[str, Any]],
                        open_with_first: bool = False) -> AsyncIterator[bytes]:
    """OpenAI's chunks: `opening(index)` first for each choice (None: none), then the tokens of
    one choice that wait together in one chunk (`choice` of them joined), every waiting chunk in
    one write; `stream.prompt` counts the usage. `open_with_first`: each choice's opening goes
    just before its first tokens (what it says, the prompt's logprobs, comes with them)."""
    obj = "chat.completion.chunk" if reply.kind == "chat" else "text_completion"
    extra = {"usage": None} if reply.include_usage else {}
    prefix, suffix = reply.chunk_framing(obj, extra)
    unopened = set(range(n))

    def openings(indexes: list[int]) -> list[bytes]:
        chunks = []
        for index in indexes:
            if index in unopened and (first := opening(index)) is not None:
                chunks += (prefix, orjson.dumps(first), suffix)
            unopened.discard(index)
        return chunks

    if not open_with_first and (first_chunks := openings(list(range(n)))):
        yield b"".join(first_chunks)
    num_generated = 0
    try:
        async for batch in events:
            num_generated += len(batch)
            chunks = []
            for one in _by_choice(batch):
                chunks += openings([one.index])
                chunks += (prefix, orjson.dumps(choice(one)), suffix)
            yield b"".join(chunks)
    except GenerationError as e:
        yield sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})
        return
    if reply.include_usage:
        usage = usage_counts(stream.prompt, num_generated)
        yield sse({**reply.envelope(obj, []), "usage": usage})
    yield sse("[DONE]")


def _by_choice(batch: list[ChoiceEvent]) -> list[ChoiceResult]:
    """A batch's events joined per choice, in the order each choice first appears."""
    joined: dict[int, ChoiceResult] = {}
    for event in batch:
        one = joined.get(event.index)
        if one is None:
            one = joined[event.index] = ChoiceResult(event.index)
        one.add(event)
    return list(joined.values())


def _chat_chunk_choice(state: AppState, reply: Reply, one: ChoiceResult) -> dict[str, Any]:
    logprobs = {"content": [_chat_logprob(state, token) for token in one.tokens]} if reply.logprobs else None
    return {"index": one.index, "delta": {"content": one.text}, "logprobs": logprobs,
            "finish_reason": one.finish_reason.openai if one.finish_reason else None}


# ---- response pieces ---------------------------------------------------------------------


def _chat_logprob(state: AppState, token: GeneratedToken) -> dict[str, Any]:
    """The sampled token and its alternatives, each named by its own bytes (`token_string`: a
    piece of a multi-byte character escaped, its `bytes` not a whole character)."""
    tok = state.tokenizer
    top = [{"token": token_string(tok, alt.token_id), "logprob": alt.logprob,
            "bytes": list(tok.token_bytes(alt.token_id))} for alt in token.top_tokens]
    return {"token": token_string(tok, token.token_id), "logprob": token.logprob,
            "bytes": list(tok.token_bytes(token.token_id)), "top_logprobs": top}


def _usage(prompt: PromptInfo, generation: Generation) -> dict[str, Any]:
    return usage_counts(prompt, generation.num_generated)


def usage_counts(prompt: PromptInfo, num_generated: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt.num_prompt_tokens,
        "completion_tokens": num_generated,
        "total_tokens": prompt.num_prompt_tokens + num_generated,
        "prompt_tokens_details": {"cached_tokens": prompt.num_cached_tokens},
    }
