"""Optional OpenTelemetry tracing (`--otlp-endpoint`): one span per finished request, with its
queue and inference phases as child spans, exported over OTLP/HTTP. Router-side only: the
shards' work shows as the inference phase. Nothing happens when the flag is unset, and the
flag is ignored with a warning when the SDK is missing (`pip install 'loom-router[otel]'`)."""

from __future__ import annotations

import logging
import time
from typing import Any

from loom_router.request_log import RequestSummary
from loom_router.tgi_metrics import RequestTimes

log = logging.getLogger("loom.tracing")
TRACES_PATH = "/v1/traces"


def traces_url(endpoint: str) -> str:
    """`http://collector:4318` -> `http://collector:4318/v1/traces` (a full URL stays)."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith(TRACES_PATH) else endpoint + TRACES_PATH


class RequestTracer:
    """Turns a finished request's timeline into spans, timed after the fact."""

    def __init__(self, provider: Any) -> None:
        from opentelemetry import trace

        self._trace = trace
        self._provider = provider
        self._tracer = provider.get_tracer("loom_router")

    def record(self, summary: RequestSummary, times: RequestTimes) -> None:
        now_ns, now = time.time_ns(), time.perf_counter()

        def wall_ns(t: float) -> int:  # a perf_counter instant on the wall clock
            return now_ns - int((now - t) * 1e9)

        attributes = {key: value for key, value in summary.fields().items() if value is not None}
        span = self._tracer.start_span("generate", start_time=wall_ns(times.arrival), attributes=attributes)
        context = self._trace.set_span_in_context(span)
        if times.scheduled is not None:
            for name, start, end in (("queue", times.validated, times.scheduled),
                                     ("inference", times.scheduled, times.end)):
                child = self._tracer.start_span(name, context=context, start_time=wall_ns(start))
                child.end(end_time=wall_ns(end))
        if summary.finish_reason in ("error", "cancelled"):
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, summary.finish_reason))
        span.end(end_time=wall_ns(times.end))

    def shutdown(self) -> None:
        """Exports what is still buffered."""
        self._provider.shutdown()


def configure_tracing(endpoint: str | None, service_name: str = "loom-router") -> RequestTracer | None:
    if endpoint is None:
        return None
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning("--otlp-endpoint %s ignored: the OpenTelemetry SDK is not installed "
                    "(pip install 'loom-router[otel]')", endpoint)
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint))))
    log.info("tracing to %s", traces_url(endpoint))
    return RequestTracer(provider)
