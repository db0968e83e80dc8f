"""`--prometheus-port`: /metrics on a port of its own (as TGI's), served by the engine core's event
loop with asyncio streams (the same exposition as /metrics on the HTTP port; no thread)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from loom_router.api_keys import is_a_key, presented_key

log = logging.getLogger("loom.metrics")
MAX_REQUEST_HEAD_BYTES = 16 << 10


async def start_metrics_server(render: Callable[[], tuple[bytes, str]], host: str, port: int,
                               api_keys: tuple[bytes, ...] = ()) -> asyncio.Server:
    """Answers `GET /metrics` (any other path: 404); one request per connection. With api_keys
    (--metrics-require-api-key), only a request that presents one (401 otherwise)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10.0)
            request_line, *header_lines = head.rstrip(b"\r\n").split(b"\r\n")
            method, path = (request_line.split(b" ") + [b"", b""])[:2]
            headers = [(name.strip(), value.strip()) for name, _, value in (h.partition(b":") for h in header_lines)]
            extra = b""
            if method != b"GET" or path.split(b"?")[0] != b"/metrics":
                body, content_type, status = b"not found\n", "text/plain", b"404 Not Found"
            elif api_keys and not is_a_key(presented_key(headers), api_keys):
                body, content_type, status = b"a valid API key is required\n", "text/plain", b"401 Unauthorized"
                extra = b"WWW-Authenticate: Bearer\r\n"
            else:
                body, content_type = render()
                status = b"200 OK"
            writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: " + content_type.encode()
                         + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n" + extra
                         + b"Connection: close\r\n\r\n" + body)
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, host, port, limit=MAX_REQUEST_HEAD_BYTES)
    log.info("metrics on http://%s:%d/metrics", host, port)
    return server
