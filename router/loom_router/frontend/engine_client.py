"""A frontend's way to the engine core (loom_router.contract): submit a request and get its
GenerationStream, cancel it, stop a choice, ask for health, metrics or a snapshot operation.

One reader callback takes every batch the core sent and feeds each output to its stream (a step's
outputs at once: detokenization runs per step, not per hop); the routes see the engine as before:
its model info and limits (from the core's Welcome), `accepting`, `validate_lengths`, `submit`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import zmq

from loom_proto.config import RouterConfig
from loom_proto.step import ModelInfo, Pooling, SamplingParams
from loom_router.contract import (
    ENGINE_SOCKET,
    Admitted,
    Batch,
    Call,
    Cancel,
    Hello,
    Limits,
    Output,
    Refused,
    Reply,
    Status,
    StopChoice,
    Submit,
    Welcome,
    check_lengths,
    encoder,
    frontend_socket,
    to_frontend_decoder,
)
from loom_router.frontend.stream import GenerationStream
from loom_router.ipc import Inbox, Sender, ipc_address, pull_socket, push_socket
from loom_router.tokenizer import Tokenizer
from loom_router.types import GenerationError, GenerationParams, SnapshotHTTPError, error_for_status, shutting_down

log = logging.getLogger("loom.frontend")

CORE_SEND_HWM = 1024  # messages to the core waiting in the socket; past it they wait in the Sender
CALL_TIMEOUT_S = 600.0  # a snapshot of a long prompt can take minutes on a CPU


class EmbeddingWaiter:
    """An embedding request's one answer, as the streams' dict holds it (feed, fail, closed)."""

    def __init__(self) -> None:
        self.group_id = -1
        self.result: asyncio.Future[list[float]] = asyncio.get_running_loop().create_future()

    @property
    def closed(self) -> bool:
        return self.result.done()

    def feed(self, output: Output, now: float) -> None:
        if output.embedding is not None and not self.result.done():
            self.result.set_result(output.embedding)

    def fail(self, status: int, message: str) -> None:
        if not self.result.done():
            self.result.set_exception(error_for_status(status, message))


class EngineClient:
    """The engine as a frontend's routes see it, backed by the engine core process."""

    def __init__(self, config: RouterConfig, tokenizer: Tokenizer, folder: str, frontend: int,
                 context: zmq.Context[Any] | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.frontend = frontend
        self._folder = folder
        self._context = context or zmq.Context.instance()
        self.model_info: ModelInfo | None = None
        self.limits: Limits | None = None
        self.core_status = Status(accepting=False, reason="not connected")
        self.draining = False  # this frontend refuses new requests (it is stopping)
        self._streams: dict[int, GenerationStream] = {}
        self._closed = False
        self._waiting: dict[int, tuple[asyncio.Future[int], GenerationStream | None]] = {}  # by ticket
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._numbers = itertools.count()
        self._welcome: asyncio.Future[Welcome] | None = None
        self._inbox: Inbox | None = None
        self._sender: Sender | None = None
        self.on_welcome: list[Any] = []  # callables(client), once the core's limits are known

    # ---- lifecycle ---------------------------------------------------------------------------

    async def start(self, timeout_s: float = 60.0) -> None:
        """Connect to the core and wait for its Welcome (the model and the limits)."""
        loop = asyncio.get_running_loop()
        self._welcome = loop.create_future()
        inbox = pull_socket(self._context, ipc_address(self._folder, frontend_socket(self.frontend)))
        self._inbox = Inbox(inbox, to_frontend_decoder.decode, self._handle)
        self._inbox.start()
        outbound = push_socket(self._context, ipc_address(self._folder, ENGINE_SOCKET), CORE_SEND_HWM)
        self._sender = Sender(outbound)
        self._send(Hello(self.frontend, os.getpid()))
        try:
            await asyncio.wait_for(asyncio.shield(self._welcome), timeout_s)
        except TimeoutError:
            raise GenerationError(f"the engine core did not answer within {timeout_s:g} s") from None

    async def close(self) -> None:
        self._closed = True
        for future in self._calls.values():
            future.cancel()
        if self._inbox is not None:
            self._inbox.close()
        if self._sender is not None:
            self._sender.close()

    # ---- the engine, as the routes see it --------------------------------------------------

    @property
    def accepting(self) -> bool:
        return self.core_status.accepting and not self.draining

    @property
    def max_total_tokens(self) -> int:
        return self.limits.max_total_tokens if self.limits else 0

    @property
    def max_input_tokens(self) -> int:
        return self.limits.max_input_tokens if self.limits else 0

    @property
    def max_batch_total_tokens(self) -> int:
        return self.limits.max_batch_total_tokens if self.limits else 0

    @property
    def max_batch_prefill_tokens(self) -> int:
        return self.limits.max_batch_prefill_tokens if self.limits else 0

    @property
    def num_in_flight(self) -> int:
        return len(self._streams) + len(self._waiting)

    def validate_lengths(self, num_input_tokens: int, max_new_tokens: int | None, n: int) -> int:
        assert self.limits is not None
        return check_lengths(self.limits, num_input_tokens, max_new_tokens, n)

    async def submit(self, prompt_ids: list[int], params: GenerationParams,
                     on_tokens: Callable[[int, int, float, float | None], None] | None = None) -> GenerationStream:
        """Queue one request at the core; its events arrive on the returned stream (and, as they
        arrive, `on_tokens(choice, count, now, gap)`: the metrics).

        Raises what the core refused it with: ValidationError (422, a constraint that does not
        compile), OverloadedError (429), UnavailableError (503), GenerationError (424).
        """
        if self.draining:
            raise shutting_down()
        ticket = next(self._numbers)
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        stream = GenerationStream(-1, self.tokenizer, prompt_ids, params, self.cancel, self.stop_choice,
                                  self._turn, self.config.stream_buffer_events, self.config.stream_interval)
        stream.on_tokens = on_tokens
        self._waiting[ticket] = (future, stream)
        constraint = params.constraint.to_contract() if params.constraint is not None else None
        self._send(Submit(self.frontend, ticket, prompt_ids, params.choices, params.max_new_tokens,
                          params.ignore_eos, params.prompt_logprobs, constraint, params.adapter,
                          stop_token_ids=params.stop_token_ids))
        try:
            stream.group_id = await future
        except asyncio.CancelledError:  # the handler went away first: cancel it once admitted
            self._waiting[ticket] = (future, None)
            raise
        return stream

    async def embed(self, prompt_ids: list[int], pooling: Pooling, adapter: str | None = None) -> list[float]:
        """One embedding request: the pooled vector of the prompt's final hidden states. It shares
        the steps and the KV budget with generation (a prefill that samples nothing). Raises the
        core's errors; a handler cancelled meanwhile cancels the request."""
        if self.draining:
            raise shutting_down()
        ticket = next(self._numbers)
        admitted: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        waiter = EmbeddingWaiter()
        self._waiting[ticket] = (admitted, waiter)  # type: ignore[assignment]
        self._send(Submit(self.frontend, ticket, prompt_ids, [SamplingParams(seed=0)], 1, adapter=adapter,
                          pooling=pooling.value))
        try:
            waiter.group_id = await admitted
        except asyncio.CancelledError:
            self._waiting[ticket] = (admitted, None)
            raise
        try:
            return await waiter.result
        except asyncio.CancelledError:
            self.cancel(waiter.group_id)
            raise

    def _turn(self) -> int:
        return self._inbox.turns if self._inbox is not None else 0

    def cancel(self, group_id: int, outcome: str = "cancelled") -> None:
        if self._streams.pop(group_id, None) is not None:
            self._send(Cancel([group_id], outcome))

    def stop_choice(self, group_id: int, index: int, num_generated: int) -> None:
        self._send(StopChoice(group_id, index, num_generated))
        stream = self._streams.get(group_id)
        if stream is not None and stream.closed:
            del self._streams[group_id]

    async def health(self) -> bool:
        """The core's loop runs and every shard answers Health."""
        try:
            return bool(await self.call("health", timeout_s=10.0))
        except (GenerationError, TimeoutError):
            return False

    async def call(self, method: str, name: str = "", token_ids: list[int] | None = None,
                   timeout_s: float = CALL_TIMEOUT_S, payload: bytes = b"", path: str = "",
                   adapter: str | None = None) -> Any:
        """One answer from the core. Raises SnapshotHTTPError or the engine error it failed with."""
        call_id = next(self._numbers)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self._send(Call(self.frontend, call_id, method, name, token_ids or [], payload, path, adapter))
        try:
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._calls.pop(call_id, None)

    def begin_drain(self) -> None:
        """Refuse new requests from now on (readiness fails at once)."""
        self.draining = True

    async def drain(self, timeout_s: float) -> None:
        """Let this frontend's streams finish within `timeout_s`; the rest then end with an error
        event (and the core frees their KV)."""
        self.begin_drain()
        deadline = time.monotonic() + timeout_s
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if not self._streams:
            return
        log.warning("%d request(s) still running after %g s of draining: ending them", len(self._streams), timeout_s)
        self._send(Cancel(list(self._streams), "error"))
        self.end_all(424, f"the server shut down before this request finished (--graceful-termination-timeout "
                          f"{timeout_s:g} s)")

    def end_all(self, status: int, message: str) -> None:
        """End every stream of this frontend with an error event, and refuse the requests still
        waiting to be admitted (nothing is sent to the core)."""
        streams, waiting = list(self._streams.values()), list(self._waiting.values())
        self._streams.clear()
        self._waiting.clear()
        for stream in streams:
            stream.fail(status, message)
        for future, _ in waiting:
            if not future.done():
                future.set_exception(error_for_status(status, message))

    # ---- the core's messages ---------------------------------------------------------------

    def _send(self, message: Any) -> None:
        assert self._sender is not None, "start() first"
        if self._closed:  # stopping: a handler that ends late (a cancel) has nothing left to tell
            return
        self._sender.send(encoder.encode(message))

    def _handle(self, message: Any) -> None:
        if isinstance(message, Batch):
            self._on_batch(message)
        elif isinstance(message, Admitted):
            self._on_admitted(message)
        elif isinstance(message, Refused):
            future, _ = self._waiting.pop(message.ticket, (None, None))
            if future is not None and not future.done():
                future.set_exception(error_for_status(message.status, message.message))
        elif isinstance(message, Reply):
            self._on_reply(message)
        elif isinstance(message, Welcome):
            self.model_info, self.limits, self.core_status = message.model_info, message.limits, message.status
            for callback in self.on_welcome:
                callback(self)
            if self._welcome is not None and not self._welcome.done():
                self._welcome.set_result(message)

    def _on_batch(self, batch: Batch) -> None:
        now = time.monotonic()
        streams = self._streams
        for output in batch.outputs:
            stream = streams.get(output.group_id)
            if stream is not None:
                stream.feed(output, now)
                if stream.closed:
                    streams.pop(output.group_id, None)
        for failure in batch.failures:
            stream = streams.pop(failure.group_id, None)
            if stream is not None:
                stream.fail(failure.status, failure.message)
        if batch.status is not None:
            self.core_status = batch.status

    def _on_admitted(self, admitted: Admitted) -> None:
        future, stream = self._waiting.pop(admitted.ticket, (None, None))
        if stream is None or future is None or future.done():  # its handler is gone
            self._send(Cancel([admitted.group_id]))
            return
        stream.group_id = admitted.group_id
        self._streams[admitted.group_id] = stream
        future.set_result(admitted.group_id)

    def _on_reply(self, reply: Reply) -> None:
        future = self._calls.get(reply.call_id)
        if future is None or future.done():
            return
        if reply.error is None:
            future.set_result(reply.value)
        elif reply.error_type:
            future.set_exception(SnapshotHTTPError(reply.status, reply.error, reply.error_type))
        else:
            future.set_exception(error_for_status(reply.status, reply.error))
