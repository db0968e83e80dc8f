"""The engine core's side of the contract (loom_router.contract): the frontends' messages in, one
outbox per frontend out.

A Submit is admitted at once (or compiled first, when it carries a constraint: on the grammar
compiler's own threads, never the loop's), and answered Admitted or Refused; its tokens then go
to its frontend's outbox. A frontend that is gone (its process died, or a new one took its index)
has its requests cancelled, so their KV is freed before the next step.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import zmq

from loom_router.contract import (
    ENGINE_SOCKET,
    Admitted,
    Call,
    Cancel,
    Hello,
    Refused,
    Reply,
    Status,
    StopChoice,
    Submit,
    Welcome,
    frontend_socket,
    to_core_decoder,
)
from loom_router.core import snapshots
from loom_router.core.engine import Engine
from loom_router.core.outbox import Outbox
from loom_router.ipc import Inbox, Sender, ipc_address, pull_socket, push_socket
from loom_router.response_store import ResponseStore
from loom_router.structured.spec import ConstraintSpec
from loom_router.types import ERROR_STATUS, EngineStats, SnapshotHTTPError, status_of

log = logging.getLogger("loom.core")

# Steps a frontend may be behind before the core holds its outputs back (and merges them).
FRONTEND_SEND_HWM = 8
ENGINE_ERRORS = tuple(ERROR_STATUS)


class EngineCoreServer:
    """Serves one Engine to the frontends over the router's private folder of sockets."""

    def __init__(self, engine: Engine, folder: str, render_metrics: Callable[[], Awaitable[bytes]],
                 context: zmq.Context[Any] | None = None) -> None:
        self.engine = engine
        self._folder = folder
        self._render_metrics = render_metrics
        self._context = context or zmq.Context.instance()
        self._outboxes: dict[int, Outbox] = {}
        self._pids: dict[int, int] = {}
        self._inbox: Inbox | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._snapshots = snapshots.Snapshots(engine)
        self.responses = ResponseStore()
        self.on_requests_lost: Callable[[int], None] | None = None  # requests of a frontend that died
        engine.status_observers.append(self._broadcast)

    def start(self) -> None:
        socket = pull_socket(self._context, ipc_address(self._folder, ENGINE_SOCKET))
        self._inbox = Inbox(socket, to_core_decoder.decode, self._handle)
        self._inbox.start()

    def close(self) -> None:
        if self._inbox is not None:
            self._inbox.close()
        for task in self._tasks:
            task.cancel()
        for outbox in self._outboxes.values():
            outbox.flush()
            outbox.close()
        self._outboxes.clear()

    def frontend_gone(self, frontend: int) -> None:
        """Its process died: cancel its requests (their blocks are freed before the next step)."""
        outbox = self._outboxes.pop(frontend, None)
        if outbox is None:
            return
        lost = self.engine.cancel_all_of(outbox, outcome="error")
        if lost:  # no frontend is left to log or count them: here, as failures
            log.warning("frontend %d is gone: its requests %s ended with it (finish_reason=error)", frontend, lost)
            if self.on_requests_lost is not None:
                self.on_requests_lost(len(lost))
        outbox.close()

    # ---- messages ---------------------------------------------------------------------------

    def _handle(self, message: Any) -> None:
        if isinstance(message, Cancel):
            for group_id in message.group_ids:
                self.engine.cancel(group_id, message.outcome)
        elif isinstance(message, StopChoice):
            self.engine.stop_choice(message.group_id, message.index, message.num_generated)
        elif isinstance(message, Submit):
            self._submit(message)
        elif isinstance(message, Call):
            self._spawn(self._call(message))
        elif isinstance(message, Hello):
            self._hello(message)

    def _hello(self, hello: Hello) -> None:
        if self._pids.get(hello.frontend) not in (None, hello.pid):
            self.frontend_gone(hello.frontend)  # a new process took the index of one that died
        self._pids[hello.frontend] = hello.pid
        outbox = Outbox(hello.frontend)
        socket = push_socket(self._context, ipc_address(self._folder, frontend_socket(hello.frontend)),
                             FRONTEND_SEND_HWM)
        outbox.attach(Sender(socket, on_drained=outbox.flush))
        self._outboxes[hello.frontend] = outbox
        engine = self.engine
        assert engine.model_info is not None and engine.limits is not None
        outbox.message(Welcome(engine.model_info, engine.limits, engine.status))
        log.info("frontend %d (pid %d) connected", hello.frontend, hello.pid)

    def _submit(self, request: Submit) -> None:
        outbox = self._outboxes.get(request.frontend)
        if outbox is None:
            return  # a frontend the core no longer serves
        if request.constraint is None:
            self._admit(outbox, request, None)
        else:
            self._spawn(self._compile_then_admit(outbox, request))

    async def _compile_then_admit(self, outbox: Outbox, request: Submit) -> None:
        assert request.constraint is not None
        try:
            spec = ConstraintSpec.from_contract(request.constraint)
            grammar = await self.engine.grammars.compile_async(spec)
        except ENGINE_ERRORS as error:
            outbox.message(Refused(request.ticket, status_of(error), str(error)))
            return
        self._admit(outbox, request, grammar)

    def _admit(self, outbox: Outbox, request: Submit, grammar: Any) -> None:
        try:
            group_id = self.engine.add(request, outbox, grammar)
        except ENGINE_ERRORS as error:
            outbox.message(Refused(request.ticket, status_of(error), str(error)))
            return
        outbox.message(Admitted(request.ticket, group_id))

    async def _call(self, call: Call) -> None:
        try:
            value = await self._answer(call)
            reply = Reply(call.call_id, value)
        except SnapshotHTTPError as error:
            reply = Reply(call.call_id, error=error.message, status=error.status, error_type=error.error_type)
        except ENGINE_ERRORS as error:
            reply = Reply(call.call_id, error=str(error), status=status_of(error))
        except Exception as error:  # a bug must not leave the frontend waiting
            log.exception("call %s failed", call.method)
            reply = Reply(call.call_id, error=f"{type(error).__name__}: {error}", status=500)
        outbox = self._outboxes.get(call.frontend)
        if outbox is not None:
            outbox.message(reply)

    async def _answer(self, call: Call) -> Any:
        if call.method == "health":
            return await self.engine.health()
        if call.method == "metrics":
            return await self._render_metrics()
        if call.method == "load":
            return load_report(self.engine.stats())
        adapters = self.engine.adapters
        if call.method == "lora_load":
            return (await adapters.load(call.name, call.path)).name
        if call.method == "lora_unload":
            await adapters.unload(call.name)
            return call.name
        if call.method == "lora_list":
            return [[adapter.name, adapter.path] for adapter in adapters.list()]
        if call.method.startswith("snapshot_"):
            return await snapshots.run(self._snapshots, call.method, call.name, call.token_ids, call.adapter)
        if call.method.startswith("response_"):  # one store for every frontend
            return self.responses.run(call.method, call.name, call.payload)
        raise ValueError(f"unknown call {call.method!r}")

    def _broadcast(self, status: Status) -> None:
        for outbox in self._outboxes.values():
            outbox.status(status)

    def _spawn(self, coroutine: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def load_report(stats: EngineStats) -> dict[str, int]:
    """What a gateway balances on: queue depth, running requests and KV tokens in use (the
    frontend turns it into the gateway's shapes, loom_router.frontend.gateway)."""
    return {"num_waiting": stats.num_waiting, "num_running": stats.num_running,
            "num_tokens_used": stats.num_blocks_used * stats.block_size,
            "num_tokens_total": stats.num_blocks_total * stats.block_size}

