"""OpenAI's /v1/completions: one prompt or a list of them (text or token ids), each run as its own
request, concurrently, with `n` choices indexed `prompt_index * n + choice` as OpenAI does; `echo`
writes a prompt back before its text, with its logprobs (lm-eval's loglikelihood reads them)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from loom_router.frontend.http_common import (
    AppState,
    ChoiceResult,
    EventStreamResponse,
    Generation,
    batches,
    encode,
    generate_all,
    get_state,
    submit,
)
from loom_router.frontend.json_body import UnicodeJSONRoute
from loom_router.frontend.openai_api import Echo, Reply, check_context, check_model, stream_chunks, usage_counts
from loom_router.frontend.text import token_string, token_texts
from loom_router.frontend.validation import CompletionRequest, check_openai, openai_generation_params
from loom_router.types import (
    APIError,
    ChoiceEvent,
    GeneratedToken,
    GenerationParams,
    PromptInfo,
    ValidationError,
)

router = APIRouter(prefix="/v1", tags=["OpenAI"], route_class=UnicodeJSONRoute)


@router.post("/completions", summary="Text completion (one prompt or a list of them)")
async def completions_route(body: CompletionRequest, request: Request) -> Any:
    state = get_state(request)
    adapter = check_model(state, body.model)
    check_openai(body, state.limits())
    _check_completion(state, body)
    prompts = await asyncio.gather(*(_prompt_ids(state, p) for p in _prompt_list(body.prompt)))
    params = [_params(state, body, ids) for ids in prompts]
    for each in params:
        each.adapter = adapter
    reply = Reply("text", adapter or state.model_name, body.logprobs is not None, body.include_usage, n=body.n)
    if body.echo:  # the prompts' token texts, off the loop (a long prompt is many tokens)
        reply.echoes = [Echo(ids, await asyncio.to_thread(token_texts, state.tokenizer, ids)) for ids in prompts]
    if body.stream:
        return await _stream(state, reply, prompts, params)
    generations = await generate_all(state, request, list(zip(prompts, params)))
    scores_only = body.max_tokens == 0
    num_generated = 0 if scores_only else sum(g.num_generated for g in generations)  # every candidate's
    generations = [_best(g, body.n) for g in generations]
    choices = [_text_choice(state, reply, _scored(c, scores_only, i * body.n), g.prompt)
               for i, g in enumerate(generations) for c in g.choices]
    return {**reply.envelope("text_completion", choices), "usage": _usage(generations, num_generated)}


def _check_completion(state: AppState, body: CompletionRequest) -> None:
    if body.suffix is not None:
        raise APIError(400, "`suffix` is not supported", "unsupported_parameter", "suffix")
    if body.max_tokens == 0 and not body.echo:
        raise APIError(400, "`max_tokens` 0 scores the prompt: it needs `echo`", None, "max_tokens")
    if body.max_tokens == 0 and body.stream:
        raise APIError(400, "`max_tokens` 0 (score the prompt) cannot stream", None, "max_tokens")
    limit = state.config.max_client_batch_size
    num_prompts = len(_prompt_list(body.prompt))
    if num_prompts > limit:
        raise ValidationError(f"`prompt` holds at most {limit} prompts (--max-client-batch-size). "
                              f"Given: {num_prompts}")


def _prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """A prompt is a string or a list of token ids; a list of those is several prompts."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return list(prompt)  # type: ignore[arg-type]
    return [prompt]  # type: ignore[list-item]


async def _prompt_ids(state: AppState, prompt: str | list[int]) -> list[int]:
    if not prompt:
        raise ValidationError("`prompt` cannot be empty")
    if isinstance(prompt, str):
        return await encode(state, prompt, field="prompt")
    vocab_size = state.engine.model_info.vocab_size
    bad = [i for i in prompt if not 0 <= i < vocab_size]
    if bad:
        raise ValidationError(f"`prompt` token ids must be in 0..{vocab_size - 1}. Given: {bad[0]}")
    return list(prompt)


def _params(state: AppState, body: CompletionRequest, ids: list[int]) -> GenerationParams:
    """One prompt's parameters; `max_tokens` 0 (score the prompt) computes one token, never returned."""
    max_tokens = body.max_tokens if body.max_tokens != 0 else 1
    check_context(state, len(ids), max_tokens, "prompt")
    max_new_tokens = state.engine.validate_lengths(len(ids), max_tokens, body.num_candidates)
    params = openai_generation_params(body, max_new_tokens, state.limits())
    params.constraint = body.constraint_spec()  # compiled by the engine core
    return params


def _best(generation: Generation, n: int) -> Generation:
    """`best_of`: the n choices with the highest logprob per token (OpenAI's "best"), indexed 0..n-1."""
    if len(generation.choices) == n:
        return generation
    ranked = sorted(generation.choices, key=lambda c: c.logprob_sum / max(len(c.tokens), 1), reverse=True)
    return replace(generation, choices=[replace(c, index=i) for i, c in enumerate(ranked[:n])])


def _scored(choice: ChoiceResult, scores_only: bool, first_index: int) -> ChoiceResult:
    """The choice under its index in the response; without its tokens when only the prompt was scored."""
    if scores_only:
        return ChoiceResult(first_index + choice.index, finish_reason=choice.finish_reason)
    return replace(choice, index=first_index + choice.index)


def _usage(generations: list[Generation], num_generated: int) -> dict[str, Any]:
    prompt = PromptInfo(sum(g.prompt.num_prompt_tokens for g in generations),
                        sum(g.prompt.num_cached_tokens for g in generations))
    return usage_counts(prompt, num_generated)


# ---- streaming --------------------------------------------------------------------------


@dataclass(slots=True)
class _Streams:
    """The streams of a request's prompts, read as one (their choices indexed across prompts)."""

    streams: list[Any]
    n: int

    @property
    def prompt(self) -> PromptInfo:
        prompts = [s.prompt for s in self.streams]
        return PromptInfo(sum(p.num_prompt_tokens for p in prompts), sum(p.num_cached_tokens for p in prompts))

    def cancel(self) -> None:
        for stream in self.streams:
            stream.cancel()

    async def events(self, timers: list[Any]) -> AsyncIterator[list[ChoiceEvent]]:
        """Every prompt's batches as they come, each event's index made `prompt * n + choice`."""
        queue: asyncio.Queue[tuple[int, list[ChoiceEvent] | BaseException | None]] = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async for batch in batches(self.streams[i], timers[i]):
                    await queue.put((i, batch))
                await queue.put((i, None))
            except Exception as e:  # the request's error, raised to the reader in order
                await queue.put((i, e))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(self.streams))]
        try:
            for _ in range(len(tasks)):
                while True:
                    i, item = await queue.get()
                    if item is None:
                        break
                    if isinstance(item, BaseException):
                        raise item
                    yield [replace(event, index=i * self.n + event.index) for event in item] if i else item
        finally:
            for task in tasks:
                task.cancel()


async def _stream(state: AppState, reply: Reply, prompts: list[list[int]], params: list[GenerationParams]) -> Response:
    submitted = []
    try:
        for ids, p in zip(prompts, params):
            submitted.append(await submit(state, ids, p))
    except BaseException:
        for stream, timer in submitted:
            stream.cancel()
            timer.finish()
        raise
    streams = _Streams([stream for stream, _ in submitted], reply.n)
    num_choices = len(prompts) * reply.n
    offsets = [len(echo.text) if (echo := reply.echo(i)) else 0 for i in range(num_choices)]  # text_offset next

    def opening(index: int) -> dict[str, Any] | None:  # echo opens each choice with its prompt
        echo = reply.echo(index)
        if echo is None:
            return None
        prompt = streams.streams[index // reply.n].prompt  # its logprobs came with the first tokens
        logprobs = _completion_logprobs(state, [], echo, prompt, 0) if reply.logprobs else None
        return {"index": index, "text": echo.text, "logprobs": logprobs, "finish_reason": None}

    def choice(one: ChoiceResult) -> dict[str, Any]:
        offset = offsets[one.index]
        offsets[one.index] += sum(len(token.text) for token in one.tokens)
        return _text_choice(state, reply, one, None, offset)

    if len(submitted) == 1:  # the common case: its batches as they are (no queue, no copies)
        stream, timer = submitted[0]
        events = batches(stream, timer)
    else:
        events = streams.events([timer for _, timer in submitted])
    chunks = stream_chunks(reply, num_choices, streams, events, opening, choice,
                           open_with_first=bool(reply.echoes) and reply.logprobs)
    return EventStreamResponse(chunks, streams.cancel)


# ---- response pieces ---------------------------------------------------------------------


def _text_choice(state: AppState, reply: Reply, choice: ChoiceResult, prompt: PromptInfo | None,
                 first_offset: int = 0) -> dict[str, Any]:
    """A completion choice. With `prompt` (a whole response) the echo comes first; a stream
    chunk (prompt None) carries only its own tokens, starting at `first_offset` in the text."""
    echo = reply.echo(choice.index) if prompt is not None else None
    logprobs = None
    if reply.logprobs:
        logprobs = _completion_logprobs(state, choice.tokens, echo, prompt, first_offset)
    text = (echo.text if echo is not None else "") + choice.text
    finish = choice.finish_reason
    return {"index": choice.index, "text": text, "logprobs": logprobs,
            "finish_reason": finish.openai if finish else None}


def _completion_logprobs(state: AppState, tokens: list[GeneratedToken], echo: Echo | None,
                         prompt: PromptInfo | None, first_offset: int) -> dict[str, Any]:
    """The legacy completions logprobs: parallel lists, echoed prompt tokens first. Each token is
    named as in top_logprobs (`_top_key`), whose entry holds the token's own logprob and its
    alternatives' (None for the prompt's first token); text_offset follows the text, where a
    character whose bytes span tokens starts at the token that completes it."""
    tokenizer = state.tokenizer
    ids: list[int] = []
    texts: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    if echo is not None and prompt is not None:
        num_prompt = len(echo.ids)
        prompt_logprobs = list(prompt.prompt_logprobs)[:num_prompt]
        prompt_logprobs += [None] * (num_prompt - len(prompt_logprobs))
        prompt_tops = list(prompt.prompt_top_tokens)[:num_prompt]
        prompt_tops += [None] * (num_prompt - len(prompt_tops))
        ids += echo.ids
        texts += echo.texts
        token_logprobs += prompt_logprobs
        for token_id, logprob, alternatives in zip(echo.ids, prompt_logprobs, prompt_tops):
            top.append(None if logprob is None else
                       _top_dict(tokenizer, token_id, logprob, alternatives or []))
    for token in tokens:
        ids.append(token.token_id)
        texts.append(token.text)
        token_logprobs.append(token.logprob)
        top.append(_top_dict(tokenizer, token.token_id, token.logprob, token.top_tokens))
    offsets, position = [], first_offset
    for text in texts:
        offsets.append(position)
        position += len(text)
    return {"tokens": [_top_key(tokenizer, token_id) for token_id in ids], "token_logprobs": token_logprobs,
            "top_logprobs": top, "text_offset": offsets}


def _top_dict(tokenizer: Any, token_id: int, logprob: float, alternatives: list[Any]) -> dict[str, float]:
    """Alternatives by text, with the token itself (as vLLM writes them)."""
    top = {_top_key(tokenizer, alt.token_id): alt.logprob for alt in alternatives}
    top.setdefault(_top_key(tokenizer, token_id), logprob)
    return top


def _top_key(tokenizer: Any, token_id: int) -> str:
    """A token as OpenAI's completions name it: its text, or for a token holding part of a UTF-8
    character, `bytes:` and its bytes escaped (`bytes:\\xe2\\x80`)."""
    return token_string(tokenizer, token_id, "bytes:")
