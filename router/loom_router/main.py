"""`loom-router`: parse a RouterConfig from flags, connect to the shards, serve the HTTP API.

SIGINT/SIGTERM stop it gracefully (loom_router.frontend.lifecycle): readiness fails and new requests
get 503 at once, in-flight requests finish within --graceful-termination-timeout (the rest
end with an error event), then the server and the engine stop and the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from loom_proto.config import RouterConfig, parse_config
from loom_proto.event_loop import run_event_loop
from loom_router.core.engine import Engine
from loom_router.core.shard_client import ShardClient
from loom_router.frontend.api import create_app
from loom_router.frontend.http_server import server_config
from loom_router.frontend.lifecycle import CLOSE_CONNECTIONS_TIMEOUT_S, DrainingServer
from loom_router.observability.metrics import RouterMetrics
from loom_router.observability.metrics_server import start_metrics_server
from loom_router.observability.request_log import configure_logging
from loom_router.observability.tracing import configure_tracing
from loom_router.tokenizer import load_tokenizer

log = logging.getLogger("loom_router")

EXIT_ENGINE_FAILED = 3  # the engine loop died (a divergence between shard ranks, or a bug)
DESCRIPTION = ("Loom's router: HTTP API, scheduler, KV block manager; drives the shards over gRPC. "
               "Started by loom-launcher, which hands it its config as JSON.")


async def serve(config: RouterConfig) -> int:
    """Runs the router until a signal stops it; returns the exit status."""
    tokenizer = await asyncio.to_thread(load_tokenizer, config.model_id)
    client = ShardClient(config.shard_uds_paths)
    try:
        await client.wait_ready(config.shard_ready_timeout)
        engine = Engine(config, client, tokenizer)
        tracer = configure_tracing(config.otlp_endpoint)
        if tracer is not None:  # each step a span, its context sent to the shards
            engine.tracer = tracer
            client.trace_metadata = tracer.grpc_metadata
        metrics = RouterMetrics(engine.stats, tracer)
        app = create_app(engine, config, metrics, manage_engine=True)  # the engine starts before the port opens
        metrics_server = None
        if config.prometheus_port is not None:
            metrics_server = await start_metrics_server(metrics, config.hostname, config.prometheus_port)
        server = DrainingServer(server_config(app, config, CLOSE_CONNECTIONS_TIMEOUT_S), engine,
                                config.graceful_termination_timeout)
        fatal: list[BaseException] = []
        engine.on_fatal = lambda error: (fatal.append(error), setattr(server, "should_exit", True))
        try:
            await server.serve()
        finally:
            if metrics_server is not None:
                metrics_server.close()
            if tracer is not None:
                await asyncio.to_thread(tracer.shutdown)
        if fatal:  # e.g. tensor-parallel ranks diverged: exit non-zero, the launcher stops everything
            log.critical("router stopping: %s", fatal[0])
            return EXIT_ENGINE_FAILED
        return 0 if server.started else 1
    finally:
        await client.close()


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
