"""The HTTP server's settings, with its defences against slow clients: a deadline for each
request's head (--header-timeout, from connecting or from the request's first byte) and one
for its body (--body-timeout), uvicorn's keep-alive idle timeout (--keep-alive-timeout) and its
connection cap (--max-connections: past it a request gets 503 at once). uvicorn has no
deadline for a head or a body: a client trickling headers a byte a second held its connection
for good; here the protocol (uvicorn's own httptools one) closes it, with a 408 when no
response was started."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from loom_proto.config import RouterConfig

log = logging.getLogger("loom_router")

_TIMEOUT_BODY = b'{"error":"the request was not received in time","error_type":"timeout"}'
REQUEST_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                   b"content-length: " + str(len(_TIMEOUT_BODY)).encode() + b"\r\n\r\n" + _TIMEOUT_BODY)


def server_config(app: Any, config: RouterConfig, graceful_shutdown_s: float) -> uvicorn.Config:
    """uvicorn's config for the router's app: its address, logs, timeouts and limits."""
    return uvicorn.Config(
        app, host=config.hostname, port=config.port, log_level=config.log_level,
        timeout_graceful_shutdown=graceful_shutdown_s, access_log=config.log_level == "debug",
        http=deadline_protocol(config.header_timeout, config.body_timeout),
        timeout_keep_alive=config.keep_alive_timeout, limit_concurrency=config.max_connections,
        **({"log_config": None} if config.json_output else {}),  # uvicorn's lines go through the JSON handler
    )


def deadline_protocol(header_timeout_s: float, body_timeout_s: float) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with the two deadlines."""

    class DeadlineProtocol(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm(header_timeout_s, "headers")

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._deadline is None:  # the next request on a kept-alive connection
                self._arm(header_timeout_s, "headers")

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()
            self._arm(body_timeout_s, "body")  # disarmed at once by a request without a body

        def on_message_complete(self) -> None:
            self._disarm()
            super().on_message_complete()

        def _arm(self, timeout_s: float, part: str) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(timeout_s, self._expire, part, timeout_s)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self, part: str, timeout_s: float) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            log.info("closing a connection from %s: its request's %s took over %g s", self.client, part, timeout_s)
            if self.cycle is None or self.cycle.response_complete:  # no response started: say why
                self.transport.write(REQUEST_TIMEOUT)
            self.transport.close()

    return DeadlineProtocol
