"""Prometheus metrics of the router: HTTP and latency metrics recorded per request, the
engine's counters and gauges read from `EngineStats` at scrape time, and TGI's metrics by
TGI's names (loom_router.observability.tgi_metrics). One registry per app."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loom_router.observability.request_log import RequestSummary, log_request
from loom_router.observability.tgi_metrics import RequestTimes, TgiMetrics, tgi_gauges
from loom_router.types import ChoiceEvent, EngineStats, FinishReason, StepRecord

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
LENGTH_BUCKETS = tuple(float(2**i) for i in range(15))  # 1 .. 16384 tokens
# The routes that generate: TGI counts these in tgi_request_count.
GENERATION_PATHS = frozenset({"/", "/generate", "/generate_stream", "/v1/completions", "/v1/chat/completions"})
SNAPSHOT_PREFIX = "/snapshots"
FAILURE_BY_STATUS = {400: "validation", 422: "validation", 429: "overloaded", 499: "cancelled"}
SUCCESS_OUTCOMES = frozenset(reason.value for reason in FinishReason)

log = logging.getLogger("loom.metrics")


@dataclass(slots=True)
class HttpRecord:
    """What one HTTP request's handlers tell the middleware (through `_current_http`)."""

    arrival: float
    timer: RequestTimer | None = None
    snapshot_failure: str | None = None  # the error_type of a failed snapshot operation


# Set by MetricsMiddleware around each request, so the handlers' `start_request` and the
# snapshot error path reach their request's record without threading it through every call.
_current_http: ContextVar[HttpRecord | None] = ContextVar("loom_http_record", default=None)


def note_snapshot_failure(reason: str) -> None:
    """Called where a snapshot operation fails: its reason labels loom_snapshot_failures."""
    record = _current_http.get()
    if record is not None:
        record.snapshot_failure = reason


class EngineStatsCollector(Collector):
    """Exports an `EngineStats` snapshot taken at scrape time."""

    def __init__(self, read_stats: Callable[[], EngineStats]) -> None:
        self._read_stats = read_stats

    def collect(self) -> Iterator[Metric]:
        s = self._read_stats()
        yield _gauge("loom_queue_size", "Requests waiting to be scheduled", s.num_waiting)
        yield _gauge("loom_running_requests", "Requests being generated", s.num_running)
        yield _gauge("loom_kv_blocks_total", "KV cache blocks on the device", s.num_blocks_total)
        yield _gauge("loom_kv_blocks_used", "KV cache blocks held by requests", s.num_blocks_used)
        yield _gauge("loom_kv_blocks_cached", "Free KV cache blocks holding a reusable prefix", s.num_blocks_cached)
        yield _counter("loom_prompt_tokens_computed", "Prompt tokens run through the model",
                       s.prompt_tokens_computed)
        yield _counter("loom_prompt_tokens_cached", "Prompt tokens served from the prefix cache",
                       s.prompt_tokens_cached)
        yield _counter("loom_generated_tokens", "Tokens generated", s.generated_tokens)
        yield _counter("loom_steps", "Engine steps run on the shards", s.steps)
        yield _counter("loom_spec_draft_tokens", "Drafted tokens sent to be verified (--speculate)",
                       s.spec_draft_tokens)
        yield _counter("loom_spec_accepted_tokens", "Drafted tokens the verification kept (--speculate)",
                       s.spec_accepted_tokens)
        yield _counter("loom_swapped_bytes", "KV bytes swapped between device and host", s.swapped_bytes)
        preemptions = CounterMetricFamily("loom_preemptions", "Requests preempted when KV memory ran out",
                                          labels=["kind"])
        preemptions.add_metric(["swap"], s.preemptions_swap)
        preemptions.add_metric(["recompute"], s.preemptions_recompute)
        yield preemptions
        finished = CounterMetricFamily("loom_requests_finished", "Finished requests by reason", labels=["reason"])
        for reason, count in sorted(s.requests_finished.items()):
            finished.add_metric([reason], count)
        yield finished
        yield _gauge("loom_host_blocks_total", "Host-RAM swap pool blocks", s.num_host_blocks_total)
        yield _gauge("loom_host_blocks_used", "Host-RAM swap pool blocks holding swapped KV", s.num_host_blocks_used)
        healthy = GaugeMetricFamily("loom_shard_healthy", "1 when the shard rank answered the last health check",
                                    labels=["rank"])
        for rank, ok in enumerate(s.shard_healthy):
            healthy.add_metric([str(rank)], 1.0 if ok else 0.0)
        yield healthy
        yield from tgi_gauges(s.num_running, s.num_waiting, s.num_blocks_used * s.block_size,
                              s.max_batch_total_tokens)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)




class RouterMetrics:
    """The router's metrics, in a registry of its own (no global state)."""

    def __init__(self, read_stats: Callable[[], EngineStats] | None = None, tracer: Any = None) -> None:
        self.tracer = tracer  # loom_router.observability.tracing.RequestTracer, with --otlp-endpoint
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("loom_http_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.time_to_first_token = Histogram("loom_time_to_first_token_seconds", "Time to the first token",
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram("loom_inter_token_latency_seconds",
                                             "Time between two tokens of one choice",
                                             buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.request_duration = Histogram("loom_request_duration_seconds", "End-to-end generation latency",
                                          buckets=LATENCY_BUCKETS, registry=r)
        self.input_length = Histogram("loom_request_input_tokens", "Prompt length in tokens",
                                      buckets=LENGTH_BUCKETS, registry=r)
        self.generated_length = Histogram("loom_request_generated_tokens", "Tokens generated per request",
                                          buckets=LENGTH_BUCKETS, registry=r)
        self.shard_step = Histogram("loom_shard_step_seconds", "One step on one shard rank, as the router waits",
                                    ["rank"], buckets=TOKEN_LATENCY_BUCKETS + (10.24, 30.0), registry=r)
        self.snapshot_operations = Counter("loom_snapshot_operations", "Snapshot operations by op and result",
                                           ["op", "result"], registry=r)
        self.snapshot_failures = Counter("loom_snapshot_failures", "Failed snapshot operations by op and reason",
                                         ["op", "reason"], registry=r)
        self.tgi = TgiMetrics(r)
        if read_stats is not None:
            r.register(EngineStatsCollector(read_stats))

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry) + self.tgi.counters.render().encode(), CONTENT_TYPE_LATEST

    def bind_engine(self, engine: Any) -> None:
        """Follow the engine's steps (TGI's batch metrics, per-rank step time)."""
        observers = getattr(engine, "step_observers", None)
        if observers is not None:
            observers.append(self.on_step)

    def on_step(self, step: StepRecord) -> None:
        self.tgi.on_batch(step.method, step.ok, step.duration_s, step.forward_s)
        for rank, seconds in enumerate(step.rank_total_s):
            self.shard_step.labels(rank=str(rank)).observe(seconds)

    def start_request(self, num_input_tokens: int, stream: Any = None, engine: Any = None) -> RequestTimer:
        """A generation was submitted: its timer, tied to the HTTP request being served."""
        self.input_length.observe(num_input_tokens)
        if engine is not None:
            self.tgi.bind_limits(engine.max_input_tokens, engine.max_total_tokens)
        self.tgi.on_lengths(num_input_tokens, getattr(stream, "max_new_tokens", None))
        record = _current_http.get()
        timer = RequestTimer(self, stream, num_input_tokens, record.arrival if record else None)
        if record is not None:
            record.timer = timer
        return timer

    def on_http_end(self, scope: dict[str, Any], record: HttpRecord, status: int) -> None:
        path = scope.get("path", "")
        if _is_generation(scope):
            self._count_generation(record, status)
        elif path.startswith(SNAPSHOT_PREFIX):
            op = _snapshot_op(scope)
            self.snapshot_operations.labels(op=op, result="ok" if status < 400 else "error").inc()
            if status >= 400:
                self.snapshot_failures.labels(op=op, reason=record.snapshot_failure or str(status)).inc()

    def _count_generation(self, record: HttpRecord, status: int) -> None:
        timer = record.timer
        if timer is None:  # refused before it reached the engine
            if status >= 400:
                self.tgi.on_failure(FAILURE_BY_STATUS.get(status, "generation"))
            return
        timer.finish()  # idempotent; a stream the client left may not have closed yet
        if timer.succeeded:
            self.tgi.on_success(timer.times(), timer.num_generated)
        else:
            self.tgi.on_failure("generation" if timer.outcome == "error" else "cancelled")


def _is_generation(scope: dict[str, Any]) -> bool:
    return scope.get("method") == "POST" and scope.get("path") in GENERATION_PATHS


def _snapshot_op(scope: dict[str, Any]) -> str:
    method = scope.get("method", "GET")
    if method == "DELETE":
        return "delete"
    if method == "GET":
        return "list"
    action = parse_qs(scope.get("query_string", b"").decode(errors="replace")).get("action", ["?"])[0]
    return action if action in ("save", "restore") else "invalid"


class RequestTimer:
    """Latency bookkeeping of one generation request, fed with its events."""

    __slots__ = ("_metrics", "_stream", "_num_input", "_arrival", "_start", "_first_token", "_end",
                 "_last_by_choice", "num_generated")

    def __init__(self, metrics: RouterMetrics, stream: Any = None, num_input_tokens: int = 0,
                 arrival: float | None = None) -> None:
        self._metrics = metrics
        self._stream = stream
        self._num_input = num_input_tokens
        self._start = time.perf_counter()
        self._arrival = arrival if arrival is not None else self._start
        self._first_token: float | None = None
        self._end: float | None = None
        self._last_by_choice: dict[int, float] = {}
        self.num_generated = 0

    def on_event(self, event: ChoiceEvent) -> None:
        now = time.perf_counter()
        if self._first_token is None:
            self._first_token = now
            self._metrics.time_to_first_token.observe(now - self._start)
        last = self._last_by_choice.get(event.index)
        if last is not None:
            self._metrics.inter_token_latency.observe(now - last)
        self._last_by_choice[event.index] = now
        self.num_generated += 1

    @property
    def outcome(self) -> str | None:
        return getattr(self._stream, "outcome", None)

    @property
    def succeeded(self) -> bool:
        """Every choice finished (the stream closed) by a finish reason, not an error or a cancel."""
        return bool(getattr(self._stream, "closed", False)) and self.outcome in SUCCESS_OUTCOMES

    def times(self) -> RequestTimes:
        end = self._end if self._end is not None else time.perf_counter()
        validated = getattr(self._stream, "submitted_at", self._start)
        return RequestTimes(self._arrival, validated, getattr(self._stream, "scheduled_at", None), end)

    def finish(self) -> None:
        """Records end-to-end latency, length and the log line once, however the request ended."""
        if self._end is not None:
            return
        self._end = time.perf_counter()
        self._metrics.request_duration.observe(self._end - self._start)
        self._metrics.generated_length.observe(self.num_generated)
        times = self.times()
        summary = RequestSummary(
            request_id=getattr(self._stream, "group_id", None),
            num_input_tokens=self._num_input,
            num_generated_tokens=self.num_generated,
            queue_s=(times.scheduled - times.validated) if times.scheduled is not None else None,
            ttft_s=(self._first_token - self._arrival) if self._first_token is not None else None,
            total_s=self._end - self._arrival,
            finish_reason=self.outcome if self.succeeded else (self.outcome or "cancelled"),
        )
        log_request(summary)
        if self._metrics.tracer is not None:
            self._metrics.tracer.record(summary, times)


class MetricsMiddleware:
    """Counts every HTTP request by its route template and response status, and TGI's request
    counts by outcome (plain ASGI, so streaming responses and disconnect detection pass through
    untouched; for a stream, the app returns once its last byte went out)."""

    def __init__(self, app: Any, metrics: RouterMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 500}
        record = HttpRecord(arrival=time.perf_counter())
        if _is_generation(scope):
            self.metrics.tgi.on_arrival()

        async def send_and_record(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        token = _current_http.set(record)
        try:
            await self.app(scope, receive, send_and_record)
        finally:
            _current_http.reset(token)
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.labels(route=path, status=str(status["code"])).inc()
            try:
                self.metrics.on_http_end(scope, record, status["code"])
            except Exception:  # metrics must never fail a request
                log.exception("recording the metrics of %s failed", scope.get("path"))
