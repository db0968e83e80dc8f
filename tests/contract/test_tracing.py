"""--otlp-endpoint: a request becomes a `generate` span with `queue` and `inference` children,
exported over OTLP/HTTP to a collector (here a local HTTP server that decodes what it gets)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from api_fakes import FakeShardClient
from test_api import router_config

from loom_router.api import create_app
from loom_router.engine import Engine
from loom_router.metrics import RouterMetrics
from loom_router.tokenizer import Tokenizer
from loom_router.tracing import configure_tracing, traces_url

pytest.importorskip("opentelemetry.sdk", reason="the otel extra is part of the test extras")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest  # noqa: E402


@pytest.fixture
def collector() -> Iterator[tuple[str, list[tuple[str, bytes]]]]:
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


def test_traces_url() -> None:
    assert traces_url("http://c:4318") == traces_url("http://c:4318/v1/traces/") == "http://c:4318/v1/traces"
    assert configure_tracing(None) is None


async def test_a_request_is_exported_as_spans(collector: tuple[str, list[tuple[str, bytes]]],
                                              backend: FakeShardClient, tokenizer: Tokenizer) -> None:  # noqa: F811
    url, received = collector
    tracer = configure_tracing(url)
    assert tracer is not None
    config = router_config()
    engine = Engine(config, backend, tokenizer)
    await engine.start()
    app = create_app(engine, config, RouterMetrics(engine.stats, tracer))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://loom") as client:
        response = await client.post("/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 3}})
        assert response.status_code == 200
    await engine.stop(drain_timeout_s=1.0)
    tracer.shutdown()  # flushes the batch
    assert [path for path, _ in received] == ["/v1/traces"]
    export = ExportTraceServiceRequest.FromString(received[0][1])
    spans = [span for rs in export.resource_spans for ss in rs.scope_spans for span in ss.spans]
    by_name = {span.name: span for span in spans}
    assert set(by_name) == {"generate", "queue", "inference"}
    root = by_name["generate"]
    assert by_name["queue"].parent_span_id == by_name["inference"].parent_span_id == root.span_id
    assert root.start_time_unix_nano <= by_name["queue"].start_time_unix_nano
    assert by_name["inference"].end_time_unix_nano == root.end_time_unix_nano
    attributes = {a.key: a.value for a in root.attributes}
    assert attributes["num_generated_tokens"].int_value == 3
    assert attributes["finish_reason"].string_value == "length"
    service = {a.key: a.value.string_value for a in export.resource_spans[0].resource.attributes}
    assert service["service.name"] == "loom-router"
