"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions (with the model's chat
template) and /v1/models, streaming or not, in the shapes the official `openai` client reads."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from loom_router.frontend.http_common import (
    AppState,
    ChoiceResult,
    EventStreamResponse,
    Generation,
    batches,
    check_input_chars,
    encode,
    generate,
    get_state,
    sse,
    submit,
)
from loom_router.frontend.json_body import UnicodeJSONRoute
from loom_router.frontend.lora_routes import adapter_models, requested_adapter
from loom_router.frontend.text import token_texts
from loom_router.frontend.tool_stream import tool_chunks
from loom_router.frontend.tools import (
    AnswerFormat,
    ToolMode,
    answer_format,
    chat_constraint_spec,
    chat_message,
    plan_tools,
    template_inputs,
    tool_format_of,
)
from loom_router.frontend.validation import (
    ChatCompletionRequest,
    CompletionRequest,
    check_openai,
    openai_generation_params,
)
from loom_router.types import (
    ChoiceEvent,
    GeneratedToken,
    GenerationError,
    GenerationParams,
    PromptInfo,
    ValidationError,
)

SYSTEM_FINGERPRINT = "loom"
MARK = "\ue000loom-choice\ue000"  # stands for a chunk's choice while its framing is cut out
ERROR_TYPES = {422: "invalid_request_error", 429: "rate_limit_error", 424: "server_error", 503: "server_error"}

router = APIRouter(prefix="/v1", tags=["OpenAI"], route_class=UnicodeJSONRoute)


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
    model = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "loom",
             "root": state.config.model_id, "parent": None, "max_model_len": state.engine.max_total_tokens}
    return {"object": "list", "data": [model, *await adapter_models(state)]}


@router.post("/completions", summary="Text completion")
async def completions_route(body: CompletionRequest, request: Request) -> Any:
    state = get_state(request)
    limits = state.limits()
    check_openai(body, limits)
    ids = await _completion_prompt_ids(state, body)
    max_new_tokens = state.engine.validate_lengths(len(ids), body.requested_max_tokens, body.n)
    params = openai_generation_params(body, max_new_tokens, limits)
    params.constraint = body.constraint_spec()  # compiled by the engine core
    params.adapter = requested_adapter(state, body.model)
    reply = _Reply("text", params.adapter or state.model_name, body.logprobs is not None, body.include_usage)
    if body.echo:  # the prompt's token texts, off the loop (a long prompt is many tokens)
        reply.echo_ids = ids
        reply.echo_texts = await asyncio.to_thread(token_texts, state.tokenizer, ids)
        reply.echo_text = "".join(reply.echo_texts)
    if body.stream:
        return await _stream(state, reply, ids, params)
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
    params.constraint = spec
    answer = answer_format(tool_plan, template, prompt)
    params.skip_special_tokens = not answer.keeps_special_tokens
    params.adapter = requested_adapter(state, body.model)
    reply = _Reply("chat", params.adapter or state.model_name, body.logprobs, body.include_usage)
    if body.stream:
        return await _stream(state, reply, ids, params, answer)
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


async def _stream(state: AppState, reply: _Reply, ids: list[int], params: GenerationParams,
                  answer: AnswerFormat | None = None) -> Response:
    stream, timer = await submit(state, ids, params)
    if answer is not None and (answer.tools.mode is not ToolMode.NONE or answer.reasoning is not None):
        chunks = tool_chunks(reply, answer, params.n, stream, batches(stream, timer), _usage_counts)
        return EventStreamResponse(chunks, stream.cancel)
    return EventStreamResponse(_chunks(state, reply, params.n, stream, batches(stream, timer)), stream.cancel)


async def _chunks(state: AppState, reply: _Reply, n: int, stream: Any,
                  events: AsyncIterator[list[ChoiceEvent]]) -> AsyncIterator[bytes]:
    """OpenAI's chunks: the tokens of one choice that wait together go in one chunk (their text
    and logprobs joined), and every waiting chunk in one write."""
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
    prefix, suffix = reply.chunk_framing(obj, extra)
    try:
        async for batch in events:
            num_generated += len(batch)
            chunks = []
            for one in _by_choice(batch):
                if reply.kind == "chat":
                    choice = _chat_chunk_choice(state, reply, one)
                else:
                    choice = _text_choice(state, reply, one, None, offsets[one.index])
                    offsets[one.index] += sum(len(token.text) for token in one.tokens)
                chunks += (prefix, orjson.dumps(choice), suffix)
            yield b"".join(chunks)
    except GenerationError as e:
        yield sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})
        return
    if reply.include_usage:
        usage = _usage_counts(stream.prompt, num_generated)
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


def _chat_chunk_choice(state: AppState, reply: _Reply, one: ChoiceResult) -> dict[str, Any]:
    logprobs = {"content": [_chat_logprob(state, token) for token in one.tokens]} if reply.logprobs else None
    return {"index": one.index, "delta": {"content": one.text}, "logprobs": logprobs,
            "finish_reason": one.finish_reason.openai if one.finish_reason else None}


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
