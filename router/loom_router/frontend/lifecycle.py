"""A frontend's life after startup: the readiness routes, and the SIGTERM drain.

Liveness (`/health`) says the engine core and shards answer; readiness (`/ready`, and KServe's
`/v2/health/ready`) says "send me work": it fails before warmup ends, while draining, and
once a shard is down, so a load balancer stops routing here before the port closes.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

log = logging.getLogger("loom_router")

READY_PATHS = ("/ready", "/v2/health/ready")
# Once the drain is over the streams have ended: uvicorn only closes idle connections.
CLOSE_CONNECTIONS_TIMEOUT_S = 5


def add_readiness_routes(app: FastAPI) -> None:
    async def ready_route(request: Request) -> JSONResponse:
        engine = request.app.state.loom.engine
        if getattr(engine, "accepting", True) and await engine.health():
            return JSONResponse({"status": "ready"})
        return JSONResponse({"error": "not ready: warming up, draining, or a shard is down",
                             "error_type": "unavailable"}, status_code=503)

    for path in READY_PATHS:
        app.add_api_route(path, ready_route, methods=["GET"], tags=["TGI"],
                          summary="200 when this server takes new requests, else 503 (warming up, "
                          "draining, a shard down)", responses={503: {"description": "not ready"}})


class DrainingServer(uvicorn.Server):
    """uvicorn, with SIGTERM/SIGINT draining first: readiness fails and new requests get 503
    at once, in-flight requests get `drain_timeout_s` to finish (the rest end with an error
    event), then the server stops and the process exits 0 (no signal re-raised).
    A second signal stops at once. `engine` is the frontend's engine client: when the engine
    core drains the whole router, its frontends' streams have ended before they get the signal."""

    def __init__(self, config: uvicorn.Config, engine: Any, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain_timeout_s = drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task[None] | None = None
        self._drain_requested = False

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not uvicorn's handler: that one re-raises the signal once served (exit status -15).
        if self._loop is None or self._drain_requested or not self.started:
            self.force_exit = self._drain_requested
            self.should_exit = True
            return
        self._drain_requested = True
        log.info("received %s: draining (up to %g s)", signal.Signals(sig).name, self.drain_timeout_s)
        self.engine.begin_drain()  # readiness fails from this instant
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self.engine.drain(self.drain_timeout_s)
        finally:
            self.should_exit = True
