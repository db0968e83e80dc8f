"""A stand-in OpenTelemetry collector for the tracing tests: a local HTTP server that keeps
each OTLP/HTTP post, and the decoding of what it got (with the proto, no SDK)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

Collector = tuple[str, list[tuple[str, bytes]]]  # its URL, and (path, body) per post


@pytest.fixture
def collector() -> Iterator[Collector]:
    received: list[tuple[str, bytes]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            received.append((self.path, self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", received
    server.shutdown()
    server.server_close()


def exported_spans(received: list[tuple[str, bytes]]) -> list[tuple[str, Any]]:
    """(service.name, span) of everything the collector got."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    spans = []
    for _, body in received:
        for rs in ExportTraceServiceRequest.FromString(body).resource_spans:
            service = {a.key: a.value.string_value for a in rs.resource.attributes}["service.name"]
            spans += [(service, span) for ss in rs.scope_spans for span in ss.spans]
    return spans


def by_name(exported: list[tuple[str, Any]]) -> dict[str, list[Any]]:
    spans: dict[str, list[Any]] = {}
    for _, span in exported:
        spans.setdefault(span.name, []).append(span)
    return spans


def attrs(span: Any) -> dict[str, Any]:
    """A span's attributes as Python values (arrays as lists)."""
    def value(v: Any) -> Any:
        kind = v.WhichOneof("value")
        return [value(x) for x in v.array_value.values] if kind == "array_value" else getattr(v, kind)
    return {a.key: value(a.value) for a in span.attributes}
