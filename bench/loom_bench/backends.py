"""One streamed request per backend (TGI's /generate_stream, OpenAI's completions and chat
completions), timed token by token: TTFT, each inter-token gap, end-to-end latency.

The client is aiohttp, as in vLLM's and SGLang's serving benchmarks: on a small machine the load
generator shares the cores with the server under test, and httpx's streaming took 2.5-3x more CPU
per token (0.52-0.60 against 0.18-0.24 ms at one stream, bench/BENCHMARKS.md), CPU taken from the
server it measures."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from loom_bench.datasets import BenchRequest


@dataclass(slots=True)
class RequestResult:
    success: bool
    server: str  # base URL it went to
    prompt_tokens: int = 0  # as the server counted them (0 when it did not say)
    output_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)  # gaps between streamed chunks
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first."""
        if self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(slots=True)
class BackendOptions:
    model: str | None
    ignore_eos: bool
    temperature: float


Backend = Callable[[aiohttp.ClientSession, str, BenchRequest, BackendOptions], Awaitable[RequestResult]]


async def _sse(response: aiohttp.ClientResponse) -> AsyncIterator[Any]:
    async for line in response.content:  # one line at a time, its newline kept
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)


class _Clock:
    """Token arrival times of one request."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.last: float | None = None
        self.ttft = 0.0
        self.gaps: list[float] = []

    def tick(self) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.ttft = now - self.start
        else:
            self.gaps.append(now - self.last)
        self.last = now

    def result(self, server: str, prompt_tokens: int, output_tokens: int) -> RequestResult:
        return RequestResult(True, server, prompt_tokens, output_tokens, self.ttft,
                             time.perf_counter() - self.start, self.gaps)


async def _post_stream(client: aiohttp.ClientSession, url: str, body: dict[str, Any],
                       on_event: Callable[[Any], None]) -> str | None:
    """Streams one request; returns an error message, or None."""
    async with client.post(url, json=body) as response:
        if response.status != 200:
            return f"HTTP {response.status}: {(await response.read()).decode(errors='replace')[:200]}"
        async for event in _sse(response):
            if isinstance(event, dict) and "error" in event:
                return f"stream error: {event['error']}"
            on_event(event)
    return None


async def tgi(client: aiohttp.ClientSession, server: str, req: BenchRequest, opts: BackendOptions) -> RequestResult:
    clock, counts = _Clock(), {"out": 0, "in": 0}
    params: dict[str, Any] = {"max_new_tokens": req.output_len, "details": True}
    if opts.temperature > 0:
        params.update(do_sample=True, temperature=opts.temperature)

    def on_event(event: dict[str, Any]) -> None:
        clock.tick()  # TGI streams one token per event
        counts["out"] += 1
        if event.get("details"):
            counts["in"] = int(event["details"].get("input_length") or 0)

    error = await _post_stream(client, f"{server}/generate_stream", {"inputs": req.prompt, "parameters": params},
                               on_event)
    return _finish(clock, server, error, counts["in"], counts["out"])


async def openai(client: aiohttp.ClientSession, server: str, req: BenchRequest, opts: BackendOptions) -> RequestResult:
    return await _openai(client, server, req, opts, chat=False)


async def openai_chat(client: aiohttp.ClientSession, server: str, req: BenchRequest,
                      opts: BackendOptions) -> RequestResult:
    return await _openai(client, server, req, opts, chat=True)


async def _openai(client: aiohttp.ClientSession, server: str, req: BenchRequest, opts: BackendOptions,
                  chat: bool) -> RequestResult:
    clock, usage = _Clock(), {"prompt_tokens": 0, "completion_tokens": 0}
    body: dict[str, Any] = {"max_tokens": req.output_len, "temperature": opts.temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if opts.model:
        body["model"] = opts.model
    if opts.ignore_eos:
        body["ignore_eos"] = True  # vLLM's and Loom's extension
    body.update({"messages": req.chat_messages()} if chat else {"prompt": req.prompt})
    chunks = {"n": 0}

    def on_event(event: dict[str, Any]) -> None:
        if event.get("usage"):
            usage.update({k: int(event["usage"].get(k) or 0) for k in usage})
        for choice in event.get("choices") or []:
            text = choice.get("delta", {}).get("content") if chat else choice.get("text")
            if text:
                clock.tick()
                chunks["n"] += 1

    path = "/v1/chat/completions" if chat else "/v1/completions"
    error = await _post_stream(client, server + path, body, on_event)
    # Without usage in the stream, each content chunk counts as one token.
    return _finish(clock, server, error, usage["prompt_tokens"], usage["completion_tokens"] or chunks["n"])


def _finish(clock: _Clock, server: str, error: str | None, prompt_tokens: int, output_tokens: int) -> RequestResult:
    if error is not None:
        return RequestResult(False, server, error=error, latency_s=time.perf_counter() - clock.start)
    return clock.result(server, prompt_tokens, output_tokens)


BACKENDS: dict[str, Backend] = {"tgi": tgi, "openai": openai, "openai-chat": openai_chat}


async def send(backend: Backend, client: aiohttp.ClientSession, server: str, req: BenchRequest,
               opts: BackendOptions) -> RequestResult:
    """A failed connection or protocol error is a failed request, not a crash of the run."""
    start = time.perf_counter()
    try:
        return await backend(client, server, req, opts)
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError, ValueError) as error:
        return RequestResult(False, server, error=f"{type(error).__name__}: {error}",
                             latency_s=time.perf_counter() - start)
