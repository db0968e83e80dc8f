"""A frontend process, started by the engine core (loom_router.core.frontends) with the HTTP socket
it bound: the TGI and OpenAI APIs on uvicorn, in front of the engine core (loom_router.contract).

SIGINT/SIGTERM drain it (loom_router.frontend.lifecycle): when the engine core stops the router it
has drained every request first, so the frontend stops at once; stopped alone, it lets its own
streams finish within --graceful-termination-timeout.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
from collections.abc import Sequence

from loom_proto.config import FrontendConfig, parse_config
from loom_proto.event_loop import freeze_startup_heap, run_event_loop
from loom_proto.process import die_with_parent
from loom_router.frontend.api import create_app
from loom_router.frontend.engine_client import EngineClient
from loom_router.frontend.http_server import server_config
from loom_router.frontend.lifecycle import CLOSE_CONNECTIONS_TIMEOUT_S, DrainingServer
from loom_router.observability.metrics import FrontendMetrics
from loom_router.observability.request_log import configure_logging
from loom_router.observability.tracing import configure_tracing
from loom_router.tokenizer import load_tokenizer

log = logging.getLogger("loom_router")

CONNECT_TIMEOUT_S = 60.0


async def serve(config: FrontendConfig) -> int:
    tokenizer = await asyncio.to_thread(load_tokenizer, config.model_id)
    await asyncio.to_thread(lambda: tokenizer.whole_token_texts)  # built here, not on the first stream
    client = EngineClient(config, tokenizer, config.ipc_folder, config.frontend_index)
    try:
        await client.start(CONNECT_TIMEOUT_S)
        tracer = configure_tracing(config.otlp_endpoint)  # each finished request: a `generate` span
        metrics = FrontendMetrics(tracer)
        app = create_app(client, config, metrics)
        server = DrainingServer(server_config(app, config, CLOSE_CONNECTIONS_TIMEOUT_S), client,
                                config.graceful_termination_timeout)
        freeze_startup_heap()
        try:
            await server.serve(sockets=[socket.socket(fileno=config.listen_fd)])
        finally:
            if tracer is not None:
                await asyncio.to_thread(tracer.shutdown)
        return 0 if server.started else 1
    finally:
        await client.close()


def main(argv: Sequence[str] | None = None) -> int:
    die_with_parent()  # the engine core
    config = parse_config(FrontendConfig, argv, "loom-router frontend", __doc__ or "")
    configure_logging(config.log_level, config.json_output, f"frontend {config.frontend_index}")
    try:
        return run_event_loop(serve(config))
    except Exception as error:  # startup failures: one clear line, not a traceback
        log.error("frontend %d failed: %s", config.frontend_index, error, exc_info=log.isEnabledFor(logging.DEBUG))
        return 1


if __name__ == "__main__":
    sys.exit(main())
