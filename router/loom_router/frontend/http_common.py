"""Plumbing shared by the TGI and OpenAI routes: the app's state, prompt tokenization,
running a generation to its end (cancelled when the client goes away), and SSE framing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import orjson
from fastapi import Request
from starlette.responses import StreamingResponse

from loom_proto.config import RouterConfig
from loom_proto.embedded import EMBEDDED_FILE_NAME, is_default_model_id
from loom_router.frontend.validation import Limits
from loom_router.observability.metrics import FrontendMetrics, RequestTimer
from loom_router.types import (
    ChoiceEvent,
    FinishReason,
    GeneratedToken,
    GenerationParams,
    PromptInfo,
    ValidationError,
)

# The default character cap per allowed input token: above any real tokenizer's average
# (about 4 for English), so only inputs that could never fit are refused untokenized.
CHARS_PER_INPUT_TOKEN = 32
# Texts up to this many characters are tokenized (and chats rendered) on the event loop: at most
# ~0.25 ms with the embedded tokenizer, while a hop to a worker thread and back costs ~0.1 ms of
# CPU by itself (more than a short prompt's tokenizing). Longer ones go to a thread, so that they
# never stall other requests' streams.
INLINE_CHARS = 1024

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before its response was ready."""


@dataclass(slots=True)
class AppState:
    """Everything a route needs, stored on `app.state.loom`."""

    config: RouterConfig
    engine: Any  # loom_router.frontend.engine_client.EngineClient (typed loosely: tests may pass their own)
    metrics: FrontendMetrics
    model_name: str

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_names(self) -> set[str]:
        """The names `model` may give the served model: its served name, and its id with its file name."""
        model_id = shown_model_id(self.config)
        names = {self.model_name, self.config.model_id, model_id, Path(model_id).name,
                 Path(model_id).name.removesuffix(".gguf")}
        return {name for name in names if name}

    @property
    def max_input_chars(self) -> int:
        """--max-input-chars, by default CHARS_PER_INPUT_TOKEN per allowed input token."""
        return self.config.max_input_chars or CHARS_PER_INPUT_TOKEN * self.engine.max_input_tokens

    def limits(self) -> Limits:
        return Limits(
            max_stop_sequences=self.config.max_stop_sequences,
            max_top_n_tokens=self.config.max_top_n_tokens,
            max_n=self.config.max_n,
            vocab_size=self.engine.model_info.vocab_size,
            eos_token_ids=tuple(self.tokenizer.eos_token_ids),
        )


def served_model_name(config: RouterConfig) -> str:
    """OpenAI's `model`: the configured name, else the model file or folder name."""
    if config.served_model_name:
        return config.served_model_name
    name = Path(config.model_id).name or "default"
    return name.removesuffix(".gguf")


def shown_model_id(config: RouterConfig) -> str:
    """The model as /info names it: --model-id, or the embedded GGUF's file name for the default."""
    return EMBEDDED_FILE_NAME if is_default_model_id(config.model_id) else config.model_id


def get_state(request: Request) -> AppState:
    return request.app.state.loom


def check_input_chars(state: AppState, num_chars: int, what: str = "inputs") -> None:
    """Refuses an input longer than --max-input-chars before any tokenizing or templating."""
    limit = state.max_input_chars
    if num_chars > limit:
        raise ValidationError(f"`{what}` must have at most {limit} characters (--max-input-chars). "
                              f"Given: {num_chars}")


async def encode(state: AppState, text: str, add_special_tokens: bool = True,
                 truncate: int | None = None, field: str = "inputs") -> list[int]:
    """Tokenizes after the character cap (an error names the request's `field`), a long text off
    the event loop; `truncate` keeps the last tokens and the model's BOS."""
    check_input_chars(state, len(text), field)
    return await off_the_loop_if(len(text) > INLINE_CHARS, state.tokenizer.encode, text, add_special_tokens,
                                 truncate)


async def off_the_loop_if(long: bool, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs): in a worker thread if `long`, else here (see INLINE_CHARS)."""
    if long:
        return await asyncio.to_thread(fn, *args, **kwargs)
    return fn(*args, **kwargs)


@dataclass(slots=True)
class ChoiceResult:
    """One choice, assembled from its events."""

    index: int
    text_parts: list[str] = field(default_factory=list)
    tokens: list[GeneratedToken] = field(default_factory=list)
    finish_reason: FinishReason | None = None

    def add(self, event: ChoiceEvent) -> None:
        self.text_parts.append(event.text)
        self.tokens.append(event.token)
        if event.finish_reason is not None:
            self.finish_reason = event.finish_reason

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def logprob_sum(self) -> float:
        return sum(token.logprob for token in self.tokens)


@dataclass(slots=True)
class Generation:
    choices: list[ChoiceResult]
    prompt: PromptInfo

    @property
    def num_generated(self) -> int:
        return sum(len(choice.tokens) for choice in self.choices)


async def submit(state: AppState, prompt_ids: list[int], params: GenerationParams) -> tuple[Any, RequestTimer]:
    """Submit to the engine core; the stream and its timer (the metrics follow its tokens)."""
    timer = state.metrics.new_timer(len(prompt_ids))
    stream = await state.engine.submit(prompt_ids, params, timer.on_tokens)
    return stream, state.metrics.start_request(timer, stream, state.engine)


async def generate(state: AppState, request: Request, prompt_ids: list[int],
                   params: GenerationParams) -> Generation:
    """Runs a request to its end; cancels it if the client disconnects first.

    Raises the engine's errors (ValidationError, OverloadedError, GenerationError)
    and ClientDisconnected.
    """
    (generation,) = await generate_all(state, request, [(prompt_ids, params)])
    return generation


async def generate_all(state: AppState, request: Request,
                       jobs: list[tuple[list[int], GenerationParams]]) -> list[Generation]:
    """Runs requests (prompt ids, params) concurrently to their end, as `generate`: the first
    error, or the client leaving, cancels every one of them."""
    consumers = [asyncio.create_task(_run(state, ids, params)) for ids, params in jobs]
    gathered = asyncio.gather(*consumers)
    gathered.add_done_callback(_retrieved)
    watcher = asyncio.create_task(wait_for_disconnect(request))
    try:
        await asyncio.wait({gathered, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not gathered.done():
            raise ClientDisconnected()
        return gathered.result()  # re-raises the first error
    finally:
        watcher.cancel()
        for consumer in consumers:
            consumer.cancel()


def _retrieved(gathered: asyncio.Future) -> None:
    """Reads the error a gather ends with once its consumers were cancelled (a CancelledError),
    which asyncio would otherwise log as never retrieved."""
    if not gathered.cancelled():
        gathered.exception()


async def _run(state: AppState, prompt_ids: list[int], params: GenerationParams) -> Generation:
    """One request's events gathered into its choices; cancelled, it cancels the request."""
    stream, timer = await submit(state, prompt_ids, params)
    choices = [ChoiceResult(i) for i in range(params.n)]
    try:
        async for event in stream:
            choices[event.index].add(event)
        return Generation(choices, stream.prompt)
    finally:
        timer.finish()
        stream.cancel()  # a no-op once the request finished


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client goes away. The body was read already, so the next ASGI
    message is the disconnect (servers hold `receive` until then or the response ends)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def batches(stream: Any, timer: RequestTimer) -> AsyncIterator[list[ChoiceEvent]]:
    """A stream's events, every waiting one at a time (a client that fell behind gets them
    together); the timer is finished however the response ends."""
    try:
        while events := await stream.take():
            yield events
    finally:
        timer.finish()


class EventStreamResponse(StreamingResponse):
    """Server-sent events whose generation is cancelled however the response ends:
    finished, client gone (even before the first byte), or the server shutting down."""

    def __init__(self, content: AsyncIterator[str | bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def sse(payload: Any) -> bytes:
    """One SSE event carrying a JSON payload (or a bare string like OpenAI's [DONE])."""
    data = payload.encode() if isinstance(payload, str) else orjson.dumps(payload)
    return b"data: " + data + b"\n\n"
