"""The router's two kinds of process in one event loop, for the contract tests: an engine core
(the real Engine and EngineCoreServer around a fake shard) and one frontend (the real
EngineClient and app), talking over the real contract on unix sockets in a private folder.

Tests reach the core's internals through `router.engine` (its scheduler, block manager, stats)
and send requests through `router.http` (the app, in process) or `router.client.submit`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
import zmq
from fastapi import FastAPI

from loom_proto.config import RouterConfig
from loom_router.core.engine import Engine
from loom_router.core.server import EngineCoreServer
from loom_router.frontend.api import create_app
from loom_router.frontend.engine_client import EngineClient
from loom_router.ipc import private_folder, remove_folder
from loom_router.observability.core_metrics import CoreMetrics
from loom_router.observability.metrics import FrontendMetrics
from loom_router.tokenizer import Tokenizer


@dataclass
class InProcessRouter:
    config: RouterConfig
    engine: Engine
    server: EngineCoreServer
    client: EngineClient
    metrics: FrontendMetrics
    core_metrics: CoreMetrics
    app: FastAPI
    folder: str
    http: httpx.AsyncClient
    extra_clients: list[EngineClient] = field(default_factory=list)

    async def start(self) -> None:
        """Warm the engine up and connect the frontend (what `router(start=False)` left undone)."""
        await self.engine.start()
        await self.client.start(timeout_s=10.0)

    async def connect_frontend(self, index: int) -> EngineClient:
        """Another frontend on the same engine core (not served over HTTP)."""
        client = EngineClient(self.config, self.engine.tokenizer, self.folder, index, self.client._context)
        await client.start(timeout_s=10.0)
        self.extra_clients.append(client)
        return client

    async def begin_drain(self) -> None:
        """The core refuses new requests; returns once the frontend knows."""
        self.engine.begin_drain()
        await wait_for(lambda: not self.client.core_status.accepting)

    async def stop(self) -> None:
        await self.http.aclose()
        for client in [self.client, *self.extra_clients]:
            await client.close()
        await self.engine.stop(drain_timeout_s=1.0)
        self.server.close()
        remove_folder(self.folder)


async def start_router(config: RouterConfig, backend: Any, tokenizer: Tokenizer, start: bool = True,
                       tracer: Any = None, core_tracer: Any = None) -> InProcessRouter:
    """An engine core and one frontend around `backend` (a fake shard client); started (warmed up
    and connected) unless start=False. `tracer` records the frontend's requests, `core_tracer`
    the engine core's steps (as loom_router.main wires it)."""
    folder = private_folder()
    context = zmq.Context.instance()
    engine = Engine(config, backend, tokenizer)
    if core_tracer is not None:
        engine.tracer = core_tracer
        backend.trace_metadata = core_tracer.grpc_metadata
    core_metrics = CoreMetrics(engine.stats)
    core_metrics.bind_engine(engine)
    metrics = FrontendMetrics(tracer)
    core_metrics.frontend_sources.append(metrics.registry)

    async def render() -> bytes:
        await engine.health()
        return core_metrics.render()[0]

    server = EngineCoreServer(engine, folder, render, context)
    server.on_requests_lost = core_metrics.on_requests_lost  # as loom_router.main wires it
    server.start()
    client = EngineClient(config, tokenizer, folder, 0, context)
    try:
        app = create_app(client, config, metrics)
    except BaseException:
        server.close()
        remove_folder(folder)
        raise
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://loom", timeout=60)
    router = InProcessRouter(config, engine, server, client, metrics, core_metrics, app, folder, http)
    if start:
        await router.start()
    return router


@asynccontextmanager
async def served_router(config: RouterConfig, backend: Any, tokenizer: Tokenizer,
                        server_class: type[uvicorn.Server] = uvicorn.Server,
                        **server_options: Any) -> AsyncIterator[tuple[str, InProcessRouter, uvicorn.Server]]:
    """The in-process router with its frontend's app served by uvicorn on config's host and port:
    (base URL, router, server)."""
    router = await start_router(config, backend, tokenizer)
    uvicorn_config = uvicorn.Config(router.app, host=config.hostname, port=config.port, log_level="warning",
                                    **server_options)
    server = server_class(uvicorn_config)
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            assert not task.done(), "the server did not start"
            await asyncio.sleep(0.01)
        yield f"http://{config.hostname}:{config.port}", router, server
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)
        await router.stop()


async def wait_for(condition: Any, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.002)


__all__ = ["InProcessRouter", "served_router", "start_router", "wait_for"]


async def settled_used_blocks(engine: Engine, timeout_s: float = 10.0) -> int:
    """The blocks still in use once the engine core has caught up: a choice that stopped on a stop
    string is freed when the core reads the frontend's StopChoice, which may come after its client's
    stream ended. Polls between steps until none is used or timeout_s passes."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (used := await engine.run_between_steps(lambda s: s.block_manager.num_used_blocks)) and loop.time() < deadline:
        await asyncio.sleep(0.01)
    return used
