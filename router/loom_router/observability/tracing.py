"""Optional OpenTelemetry tracing (`--otlp-endpoint`), exported over OTLP/HTTP.

- A finished request is a `generate` span with its `queue` and `inference` phases as children,
  timed after the fact (one trace per request).
- Each engine step is a `step` span (one trace per step: a step serves many requests, a request
  spans many steps). Its context goes to every shard rank as W3C `traceparent` gRPC metadata,
  so each rank's `shard.step` span (loom_shard.tracing) is its child. The requests it served are
  its `loom.request_ids` attribute, the ids their `generate` spans carry as `request_id`.

Nothing happens when the flag is unset, and the flag is ignored with a warning when the SDK is
missing (`pip install 'loom-router[otel]'`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from loom_proto.step import StepPlan
from loom_proto.tracing import ATTR_REQUEST_IDS, ROUTER_STEP_SPAN, StepCounts, traces_url
from loom_router.core.shard_client import Metadata
from loom_router.observability.request_log import RequestSummary
from loom_router.observability.tgi_metrics import RequestTimes

log = logging.getLogger("loom.tracing")

__all__ = ["Metadata", "RequestTracer", "configure_tracing", "traces_url"]


class RequestTracer:
    """The router's spans: a finished request's timeline (after the fact) and each step (live,
    the current span while the shards run it, so that `grpc_metadata` carries its context)."""

    def __init__(self, provider: Any) -> None:
        from opentelemetry import propagate, trace

        self._trace = trace
        self._propagate = propagate
        self._provider = provider
        self._tracer = provider.get_tracer("loom_router")

    def record(self, summary: RequestSummary, times: RequestTimes) -> None:
        now_ns, now = time.time_ns(), time.monotonic()

        def wall_ns(t: float) -> int:  # a monotonic instant on the wall clock
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

    @contextmanager
    def step(self, plan: StepPlan, request_ids: list[int]) -> Iterator[None]:
        """The `step` span around one step on the shards; an exception marks it failed."""
        attributes: dict[str, Any] = {ATTR_REQUEST_IDS: request_ids, **StepCounts.of(plan).attributes()}
        with self._tracer.start_as_current_span(ROUTER_STEP_SPAN, attributes=attributes):
            yield

    def span(self, name: str, attributes: dict[str, Any]) -> AbstractContextManager[object]:
        """A live span, current in its body (an exception marks it failed): the router's side of
        an operation whose shard calls carry its context (snapshot save / restore)."""
        return self._tracer.start_as_current_span(name, attributes=attributes)

    def grpc_metadata(self) -> Metadata | None:
        """The current span's context as gRPC metadata (W3C `traceparent`, through the global
        propagator, as the shards extract it); None outside a span."""
        carrier: dict[str, str] = {}
        self._propagate.inject(carrier)
        return tuple(carrier.items()) or None

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
