"""`--prometheus-port`: /metrics on a port of its own (as TGI's), served by the engine core's event
loop with asyncio streams (the same exposition as /metrics on the HTTP port; no thread)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

log = logging.getLogger("loom.metrics")
MAX_REQUEST_HEAD_BYTES = 16 << 10


async def start_metrics_server(render: Callable[[], tuple[bytes, str]], host: str, port: int) -> asyncio.Server:
    """Answers `GET /metrics` (any other path: 404); one request per connection."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10.0)
            method, path = (head.split(b"\r\n", 1)[0].split(b" ") + [b"", b""])[:2]
            if method == b"GET" and path.split(b"?")[0] == b"/metrics":
                body, content_type = render()
                status = b"200 OK"
            else:
                body, content_type, status = b"not found\n", "text/plain", b"404 Not Found"
            writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: " + content_type.encode()
                         + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n"
                         + body)
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, host, port, limit=MAX_REQUEST_HEAD_BYTES)
    log.info("metrics on http://%s:%d/metrics", host, port)
    return server
