"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions (with the model's chat
template) and /v1/models, streaming or not, in the shapes the official `openai` client reads."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from loom_router.http_common import (
    AppState,
    ChoiceResult,
    EventStreamResponse,
    Generation,
    check_input_chars,
    encode,
    generate,
    get_state,
    sse,
    tracked,
)
from loom_router.structured import compile_constraint
from loom_router.text import token_texts
from loom_router.tool_stream import tool_chunks
from loom_router.tools import (
    AnswerFormat,
    ToolMode,
    answer_format,
    chat_constraint_spec,
    chat_message,
    plan_tools,
    template_inputs,
    tool_format_of,
)
from loom_router.types import (
    ChoiceEvent,
    GeneratedToken,
    GenerationError,
    GenerationParams,
    PromptInfo,
    ValidationError,
)
from loom_router.validation import (
    ChatCompletionRequest,
    CompletionRequest,
    check_openai,
    openai_generation_params,
)

SYSTEM_FINGERPRINT = "loom"
ERROR_TYPES = {422: "invalid_request_error", 429: "rate_limit_error", 424: "server_error", 503: "server_error"}

router = APIRouter(prefix="/v1", tags=["OpenAI"])


def is_openai_path(path: str) -> bool:
    return path.startswith("/v1/")


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    error = {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
             "param": param, "code": None}
    return JSONResponse({"error": error}, status_code=status)


@dataclass(slots=True)
class _Reply:
    """What every response of one request shares."""

    kind: str  # "chat" or "text"
    model: str
    logprobs: bool
    include_usage: bool
    echo_ids: list[int] | None = None  # completions with echo: the prompt, written before the text
    echo_text: str = ""
    echo_texts: list[str] = field(default_factory=list)  # the text each echoed prompt token adds
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
        return {"id": f"{prefix}-{self.id}", "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": SYSTEM_FINGERPRINT, "choices": choices}


# ---- routes -----------------------------------------------------------------------------


@router.get("/models", summary="The served model")
async def models_route(request: Request) -> dict[str, Any]:
    state = get_state(request)
    model = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "loom",
             "root": state.config.model_id, "max_model_len": state.engine.max_total_tokens}
    return {"object": "list", "data": [model]}


@router.post("/completions", summary="Text completion")
async def completions_route(body: CompletionRequest, request: Request) -> Any:
    state = get_state(request)
    limits = state.limits()
    check_openai(body, limits)
    ids = await _completion_prompt_ids(state, body)
    max_new_tokens = state.engine.validate_lengths(len(ids), body.requested_max_tokens, body.n)
    params = openai_generation_params(body, max_new_tokens, limits)
    params.grammar = await compile_constraint(state.engine, body.constraint_spec())
    reply = _Reply("text", state.model_name, body.logprobs is not None, body.include_usage)
    if body.echo:  # the prompt's token texts, off the loop (a long prompt is many tokens)
        reply.echo_ids = ids
        reply.echo_texts = await asyncio.to_thread(token_texts, state.tokenizer, ids)
        reply.echo_text = "".join(reply.echo_texts)
    if body.stream:
        return _stream(state, reply, ids, params)
    generation = await generate(state, request, ids, params)
    choices = [_text_choice(state, reply, c, generation.prompt) for c in generation.choices]
    return {**reply.envelope("text_completion", choices), "usage": _usage(generation.prompt, generation)}


@router.post("/chat/completions", summary="Chat completion with the model's chat template")
async def chat_route(body: ChatCompletionRequest, request: Request) -> Any:
    state = get_state(request)
    limits = state.limits()
    check_openai(body, limits)
    template = state.tokenizer.chat_template
    tool_plan = plan_tools(body, tool_format_of(template))
    spec = chat_constraint_spec(body.constraint_spec(), tool_plan)
    messages, extra = template_inputs(state.tokenizer, [m.as_template_message() for m in body.messages], tool_plan)
    check_input_chars(state, sum(len(str(m.get("content") or "")) for m in messages), "messages")
    extra = {**(body.chat_template_kwargs or {}), **extra}  # vLLM's: e.g. Qwen3's enable_thinking
    prompt = await asyncio.to_thread(state.tokenizer.apply_chat_template, messages, True, **extra)
    ids = await encode(state, prompt, add_special_tokens=False)  # the template wrote the specials
    max_new_tokens = state.engine.validate_lengths(len(ids), body.requested_max_tokens, body.n)
    params = openai_generation_params(body, max_new_tokens, limits)
    params.grammar = await compile_constraint(state.engine, spec)
    answer = answer_format(tool_plan, template, prompt)
    params.skip_special_tokens = not answer.keeps_special_tokens
    reply = _Reply("chat", state.model_name, body.logprobs, body.include_usage)
    if body.stream:
        return _stream(state, reply, ids, params, answer)
    generation = await generate(state, request, ids, params)
    choices = []
    for c in generation.choices:
        message, finish = chat_message(answer, c.text, c.finish_reason)
        choices.append({
            "index": c.index,
            "message": message,
            "logprobs": {"content": [_chat_logprob(state, t) for t in c.tokens]} if reply.logprobs else None,
            "finish_reason": finish,
        })
    return {**reply.envelope("chat.completion", choices), "usage": _usage(generation.prompt, generation)}


async def _completion_prompt_ids(state: AppState, body: CompletionRequest) -> list[int]:
    """A prompt is a string, a list of token ids, or a list holding one of those."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ValidationError(f"`prompt` must be a single prompt; batches are not supported. Given: {len(prompt)}")
        prompt = prompt[0]
    if not prompt:
        raise ValidationError("`prompt` cannot be empty")
    if isinstance(prompt, str):
        return await encode(state, prompt)
    vocab_size = state.engine.model_info.vocab_size
    bad = [i for i in prompt if not 0 <= i < vocab_size]
    if bad:
        raise ValidationError(f"`prompt` token ids must be in 0..{vocab_size - 1}. Given: {bad[0]}")
    return list(prompt)


# ---- streaming --------------------------------------------------------------------------


def _stream(state: AppState, reply: _Reply, ids: list[int], params: GenerationParams,
            answer: AnswerFormat | None = None) -> Response:
    stream = state.engine.submit(ids, params)
    timer = state.metrics.start_request(len(ids), stream, state.engine)
    if answer is not None and (answer.tools.mode is not ToolMode.NONE or answer.reasoning is not None):
        chunks = tool_chunks(reply, answer, params.n, stream, tracked(stream, timer), _usage_counts)
        return EventStreamResponse(chunks, stream.cancel)
    return EventStreamResponse(_chunks(state, reply, params.n, stream, tracked(stream, timer)), stream.cancel)


async def _chunks(state: AppState, reply: _Reply, n: int, stream: Any,
                  events: AsyncIterator[ChoiceEvent]) -> AsyncIterator[str]:
    obj = "chat.completion.chunk" if reply.kind == "chat" else "text_completion"
    extra = {"usage": None} if reply.include_usage else {}
    for index in range(n):  # OpenAI opens every chat choice with the role; echo opens text ones
        if reply.kind == "chat":
            opening = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                       "finish_reason": None}
        elif reply.echo_text:
            opening = {"index": index, "text": reply.echo_text, "logprobs": None, "finish_reason": None}
        else:
            continue
        yield sse({**reply.envelope(obj, [opening]), **extra})
    num_generated = 0
    offsets = [len(reply.echo_text)] * n  # text_offset of each choice's next token
    try:
        async for event in events:
            num_generated += 1
            if reply.kind == "chat":
                choice = _chat_chunk_choice(state, reply, event)
            else:
                one = ChoiceResult(event.index, [event.text], [event.token], event.finish_reason)
                choice = _text_choice(state, reply, one, None, offsets[event.index])
                offsets[event.index] += len(event.token.text)
            yield sse({**reply.envelope(obj, [choice]), **extra})
    except GenerationError as e:
        yield sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})
        return
    if reply.include_usage:
        usage = _usage_counts(stream.prompt, num_generated)
        yield sse({**reply.envelope(obj, []), "usage": usage})
    yield sse("[DONE]")


def _chat_chunk_choice(state: AppState, reply: _Reply, event: ChoiceEvent) -> dict[str, Any]:
    logprobs = {"content": [_chat_logprob(state, event.token)]} if reply.logprobs else None
    return {"index": event.index, "delta": {"content": event.text}, "logprobs": logprobs,
            "finish_reason": event.finish_reason.openai if event.finish_reason else None}


# ---- response pieces ---------------------------------------------------------------------


def _text_choice(state: AppState, reply: _Reply, choice: ChoiceResult, prompt: PromptInfo | None,
                 first_offset: int = 0) -> dict[str, Any]:
    """A completion choice. With `prompt` (a whole response) the echo comes first; a stream
    chunk (prompt None) carries only its own tokens, starting at `first_offset` in the text."""
    echo_ids = reply.echo_ids if prompt is not None else None
    logprobs = None
    if reply.logprobs:
        echo = (echo_ids, reply.echo_texts) if echo_ids is not None else None
        logprobs = _completion_logprobs(state, choice.tokens, echo, prompt, first_offset)
    text = (reply.echo_text if echo_ids is not None else "") + choice.text
    finish = choice.finish_reason
    return {"index": choice.index, "text": text, "logprobs": logprobs,
            "finish_reason": finish.openai if finish else None}


def _completion_logprobs(state: AppState, tokens: list[GeneratedToken], echo: tuple[list[int], list[str]] | None,
                         prompt: PromptInfo | None, first_offset: int) -> dict[str, Any]:
    """The legacy completions logprobs: parallel lists, echoed prompt tokens (ids, texts) first.
    Each token's text is what it adds to the output, so text_offset follows the text."""
    decode = state.tokenizer.decode
    texts: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    if echo is not None:
        prompt_ids, prompt_texts = echo
        prompt_logprobs = list(prompt.prompt_logprobs) if prompt is not None else []
        prompt_logprobs += [None] * (len(prompt_ids) - len(prompt_logprobs))
        texts += prompt_texts
        token_logprobs += prompt_logprobs
        top += [None] * len(prompt_ids)
    for token in tokens:
        texts.append(token.text)
        token_logprobs.append(token.logprob)
        top.append({decode([t.token_id]): t.logprob for t in token.top_tokens})
    offsets, position = [], first_offset
    for text in texts:
        offsets.append(position)
        position += len(text)
    return {"tokens": texts, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _chat_logprob(state: AppState, token: GeneratedToken) -> dict[str, Any]:
    """`token` is the text the token adds (as the stream's); `bytes` its raw bytes, which
    for a piece of a multi-byte character are not a whole character."""
    tok = state.tokenizer
    top = [{"token": tok.decode([alt.token_id]), "logprob": alt.logprob,
            "bytes": list(tok.token_bytes(alt.token_id))} for alt in token.top_tokens]
    return {"token": token.text, "logprob": token.logprob, "bytes": list(tok.token_bytes(token.token_id)),
            "top_logprobs": top}


def _usage(prompt: PromptInfo, generation: Generation) -> dict[str, Any]:
    return _usage_counts(prompt, generation.num_generated)


def _usage_counts(prompt: PromptInfo, num_generated: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt.num_prompt_tokens,
        "completion_tokens": num_generated,
        "total_tokens": prompt.num_prompt_tokens + num_generated,
        "prompt_tokens_details": {"cached_tokens": prompt.num_cached_tokens},
    }
