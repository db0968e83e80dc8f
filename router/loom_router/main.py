"""`loom-router`: the engine core process. It connects to the shards, warms up, binds the HTTP
socket and starts `--api-workers` frontend processes on it (loom_router.frontend.main), then runs
the engine loop, serving the frontends through loom_router.contract; it serves no HTTP itself
(but `--prometheus-port`).

SIGINT/SIGTERM stop it gracefully: readiness fails and new requests get 503 at once on every
frontend, in-flight requests finish within --graceful-termination-timeout (the rest end with an
error event), then the frontends, the engine and the process stop with exit status 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Sequence

from prometheus_client.multiprocess import MultiProcessCollector

from loom_proto.cgroup import available_cpus
from loom_proto.config import RouterConfig, parse_config
from loom_proto.event_loop import freeze_startup_heap, run_event_loop
from loom_router.api_keys import load_api_keys
from loom_router.core.engine import Engine
from loom_router.core.frontends import FrontendPool, default_api_workers, listening_socket
from loom_router.core.server import EngineCoreServer
from loom_router.core.shard_client import ShardClient
from loom_router.ipc import private_folder, remove_folder
from loom_router.observability.core_metrics import CoreMetrics
from loom_router.observability.metrics_server import start_metrics_server
from loom_router.observability.request_log import configure_logging
from loom_router.observability.tracing import configure_tracing
from loom_router.tokenizer import load_tokenizer

log = logging.getLogger("loom_router")

EXIT_ENGINE_FAILED = 3  # the engine loop died (a divergence between shard ranks, or a bug), or a frontend kept dying
DESCRIPTION = ("Loom's router: the engine core (scheduler, KV block manager, shard client) and its HTTP "
               "frontends (TGI and OpenAI APIs); drives the shards over gRPC (steps over their step sockets). "
               "Started by loom-launcher, which "
               "hands it its config as JSON.")
FRONTEND_STOP_TIMEOUT_S = 10.0


class Stop:
    """Why the router stops: a signal (drain first) or a fatal error (at once, exit status 3)."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.fatal: str | None = None
        self.signalled = 0

    def on_fatal(self, reason: str) -> None:
        if self.fatal is None:
            self.fatal = reason
        self.event.set()

    def on_signal(self) -> None:
        self.signalled += 1
        self.event.set()


async def serve(config: RouterConfig) -> int:
    """Runs the router until a signal stops it; returns the exit status."""
    tokenizer = await asyncio.to_thread(load_tokenizer, config.model_id)
    client = ShardClient(config.shard_targets(), config.resolved_shard_secret())
    stop = Stop()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):  # from the start: a stop while starting cleans up too
        loop.add_signal_handler(signum, stop.on_signal)
    folder = private_folder()
    try:
        if not await _unless_stopped(stop, client.wait_ready(config.shard_ready_timeout)):
            log.info("stopped while waiting for the shards")
            return 0
        engine = Engine(config, client, tokenizer)
        tracer = configure_tracing(config.otlp_endpoint)
        if tracer is not None:  # each step a span, its context sent to the shards
            engine.tracer = tracer
            client.trace_metadata = tracer.grpc_metadata
        engine.on_fatal = lambda error: stop.on_fatal(f"the engine loop died: {error}")
        metrics = CoreMetrics(engine.stats)
        metrics.bind_engine(engine)
        if not await _unless_stopped(stop, engine.start()):  # warmup takes a while: a stop need not wait
            log.info("stopped while warming up")
            return 0
        return await _serve_frontends(config, engine, metrics, folder, stop)
    finally:
        await client.close()
        remove_folder(folder)


async def _unless_stopped(stop: Stop, work: Awaitable[object]) -> bool:
    """Awaits `work` unless a stop comes first (it is then cancelled): whether it finished."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.event.wait())
    await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if task.done():
        task.result()  # its error, if it failed
        return True
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return False


async def _serve_frontends(config: RouterConfig, engine: Engine, metrics: CoreMetrics, folder: str,
                           stop: Stop) -> int:
    metrics_folder = os.path.join(folder, "metrics")
    os.mkdir(metrics_folder)
    metrics.frontend_sources.append(MultiProcessCollector(None, path=metrics_folder))

    async def render() -> bytes:
        await engine.health()  # refreshes loom_shard_healthy (a cheap RPC per rank)
        return metrics.render()[0]

    server = EngineCoreServer(engine, folder, render)
    server.on_requests_lost = metrics.on_requests_lost
    server.start()
    listen = listening_socket(config.hostname, config.port)
    num_workers = config.api_workers or default_api_workers(available_cpus())
    pool = FrontendPool(config, num_workers, folder, listen, metrics_folder, server.frontend_gone, stop.on_fatal)
    metrics_server = None
    try:
        freeze_startup_heap()
        pool.start()
        log.info("engine core serving %d frontend(s) on %s:%d", num_workers, config.hostname, config.port)
        if config.prometheus_port is not None:
            keys = load_api_keys(config) if config.metrics_require_api_key else ()
            metrics_server = await start_metrics_server(metrics.render, config.hostname, config.prometheus_port, keys)
        await stop.event.wait()
        if stop.fatal is None:
            await _drain(engine, stop, config.graceful_termination_timeout)
    finally:
        await pool.stop(FRONTEND_STOP_TIMEOUT_S)
        if metrics_server is not None:
            metrics_server.close()
        server.close()
        listen.close()
        await engine.stop(drain_timeout_s=0.0)
        if engine.tracer is not None:
            await asyncio.to_thread(engine.tracer.shutdown)
    if stop.fatal is not None:
        log.critical("router stopping: %s", stop.fatal)
        return EXIT_ENGINE_FAILED
    return 0


async def _drain(engine: Engine, stop: Stop, timeout_s: float) -> None:
    """Readiness fails on every frontend at once; in-flight requests get `timeout_s` (the rest end
    with an error event). A second signal, or a fatal error, ends the wait."""
    log.info("draining (up to %g s)", timeout_s)
    stop.event.clear()
    await _unless_stopped(stop, engine.drain(timeout_s))
    await asyncio.sleep(0.05)  # the last error events reach the frontends before they stop


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(RouterConfig, argv, "loom-router", DESCRIPTION)
    configure_logging(config.log_level, config.json_output)
    try:
        return run_event_loop(serve(config))
    except Exception as error:  # startup failures: one clear line, not a traceback
        log.error("router failed: %s", error, exc_info=log.isEnabledFor(logging.DEBUG))
        return 1


if __name__ == "__main__":
    sys.exit(main())
