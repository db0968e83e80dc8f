"""The shard's OpenTelemetry spans (`--otlp-endpoint`, `pip install 'loom-shard[otel]'`).

Each Step is a `shard.step` span, child of the router's `step` span whose context arrives as
W3C `traceparent` gRPC metadata; its children `shard.prepare`, `shard.forward` and
`shard.sample` are timed by the runner (StepPhases) and created after the step, so the
forward itself runs no tracing code. Snapshot save / load / fill / commit are spans too.

Tracing off (no flag, or no SDK: one warning) means no ShardTracer at all: the server's hot
path then costs one None check, and the runner's two more.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from loom_proto.snapshot import SnapshotReply, SnapshotStatus
from loom_proto.step import StepPlan
from loom_proto.tracing import (
    ATTR_RANK,
    ATTR_SNAPSHOT_STATUS,
    SHARD_FORWARD_SPAN,
    SHARD_PREPARE_SPAN,
    SHARD_SAMPLE_SPAN,
    SHARD_SNAPSHOT_SPAN_PREFIX,
    SHARD_STEP_SPAN,
    StepCounts,
    traces_url,
)

log = logging.getLogger("loom_shard.tracing")

# The snapshot RPCs that get a span, and their span's suffix.
SNAPSHOT_SPANS = {"SaveSnapshot": "save", "LoadSnapshot": "load", "FillSnapshot": "fill", "CommitSnapshot": "commit"}


@dataclass(slots=True)
class StepPhases:
    """perf_counter instants of one step's phases, written by the runner only when it is given
    one (tracing on). None: the phase did not happen (no sequence to compute, or it failed)."""

    start: float | None = None
    forward_start: float | None = None
    sample_start: float | None = None
    end: float | None = None

    def spans(self) -> list[tuple[str, float, float]]:
        """(name, start, end) of each phase that ran."""
        bounds = [(SHARD_PREPARE_SPAN, self.start, self.forward_start),
                  (SHARD_FORWARD_SPAN, self.forward_start, self.sample_start),
                  (SHARD_SAMPLE_SPAN, self.sample_start, self.end)]
        return [(name, start, end) for name, start, end in bounds if start is not None and end is not None]


def _wall_clock() -> Any:
    """perf_counter instant -> wall-clock ns (OpenTelemetry's times), anchored once per call."""
    now_ns, now = time.time_ns(), time.perf_counter()
    return lambda t: now_ns - int((now - t) * 1e9)


class ShardTracer:
    """Makes the spans of one shard rank; the router's context comes in each call's metadata."""

    def __init__(self, provider: Any, rank: int) -> None:
        from opentelemetry import propagate, trace

        self._trace = trace
        self._propagate = propagate
        self._provider = provider
        self._tracer = provider.get_tracer("loom_shard")
        self.rank = rank

    def parent(self, metadata: Iterable[tuple[str, Any]] | None) -> Any:
        """The caller's context from gRPC metadata (through the global propagator, W3C by
        default, as the router injects it); an empty context when there is none."""
        carrier = {key: value for key, value in metadata or () if isinstance(value, str)}
        return self._propagate.extract(carrier)

    @contextmanager
    def step(self, metadata: Iterable[tuple[str, Any]] | None, plan: StepPlan) -> Iterator[StepPhases]:
        """The `shard.step` span around a step; the body fills the StepPhases it yields, whose
        phases become child spans. An exception marks the span failed and propagates."""
        phases = StepPhases()
        attributes = {ATTR_RANK: self.rank, **StepCounts.of(plan).attributes()}
        with self._tracer.start_as_current_span(SHARD_STEP_SPAN, context=self.parent(metadata),
                                                attributes=attributes) as span:
            try:
                yield phases
            finally:
                self._phase_spans(span, phases)

    def _phase_spans(self, parent: Any, phases: StepPhases) -> None:
        wall_ns = _wall_clock()
        context = self._trace.set_span_in_context(parent)
        for name, start, end in phases.spans():
            child = self._tracer.start_span(name, context=context, start_time=wall_ns(start))
            child.end(end_time=wall_ns(end))

    async def snapshot(self, rpc: str, metadata: Iterable[tuple[str, Any]] | None,
                       call: Awaitable[SnapshotReply]) -> SnapshotReply:
        """A `shard.snapshot.<op>` span around a snapshot call; its status is an attribute, and
        a status other than OK marks the span failed."""
        name = SHARD_SNAPSHOT_SPAN_PREFIX + SNAPSHOT_SPANS[rpc]
        with self._tracer.start_as_current_span(name, context=self.parent(metadata),
                                                attributes={ATTR_RANK: self.rank}) as span:
            reply = await call
            span.set_attribute(ATTR_SNAPSHOT_STATUS, reply.status.value)
            if reply.status is not SnapshotStatus.OK:
                span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, reply.message))
            return reply

    def shutdown(self) -> None:
        """Exports what is still buffered."""
        self._provider.shutdown()


def configure_tracing(endpoint: str | None, rank: int) -> ShardTracer | None:
    """A tracer exporting to `endpoint` over OTLP/HTTP; None when unset, or (with one warning)
    when the OpenTelemetry SDK is not installed: the shard then serves untraced."""
    if endpoint is None:
        return None
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning("--otlp-endpoint %s ignored by shard rank %d: the OpenTelemetry SDK is not installed "
                    "(pip install 'loom-shard[otel]')", endpoint, rank)
        return None
    resource = Resource.create({"service.name": "loom-shard", ATTR_RANK: rank})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint))))
    return ShardTracer(provider, rank)
