"""A frontend's life after startup: the readiness routes, and the SIGTERM drain.

Liveness (`/health`) says the engine core and shards answer; readiness (`/ready`, and KServe's
`/v2/health/ready`) says "send me work": it fails before warmup ends, while draining, and
once a shard is down, so a load balancer stops routing here before the port closes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from pathlib import Path
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
        self._core_pid = os.getppid()  # the engine core: a signal after it died leaves nothing to drain

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not uvicorn's handler: that one re-raises the signal once served (exit status -15).
        if self._loop is None or self._drain_requested or not self.started:
            # A second signal stops at once; not one that follows the engine core's death (the
            # drain then ends every request at once anyway, and the app's shutdown still runs).
            self.force_exit = self._drain_requested and not self._core_dead()
            self.should_exit = True
            return
        self._drain_requested = True
        self.engine.begin_drain()  # readiness fails from this instant
        self._loop.call_soon_threadsafe(self._start_drain, signal.Signals(sig).name)

    def _start_drain(self, sig: str) -> None:
        self._drain = asyncio.ensure_future(self._drain_then_exit(sig))

    async def _drain_then_exit(self, sig: str) -> None:
        try:
            # With requests in flight, tell the engine core's death (this signal is its death
            # signal: nothing will finish them) from a stop that lets them finish.
            if self.engine.num_in_flight and await self._core_gone():
                log.error("received %s: the engine core is gone; ending every request now", sig)
                self.engine.end_all(503, "the engine core stopped before this request finished")
            else:
                log.info("received %s: draining (up to %g s)", sig, self.drain_timeout_s)
                await self.engine.drain(self.drain_timeout_s)
        finally:
            self.should_exit = True

    def _core_dead(self) -> bool:
        return os.getppid() != self._core_pid or not _alive(self._core_pid)

    async def _core_gone(self, wait_s: float = 1.0) -> bool:
        """Whether the engine core died: a dying process's children are handed to another parent
        (or it is a zombie) within moments of the death signal; a live core stays as it is."""
        deadline = time.monotonic() + wait_s
        while not self._core_dead():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True


def _alive(pid: int) -> bool:
    """A process that runs (not a zombie, not gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (not Linux): whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
