"""A frontend's Prometheus metrics: HTTP and latency metrics recorded per request, and TGI's
request metrics by TGI's names (loom_router.observability.tgi_metrics).

Under the router's processes they live in prometheus_client's multiprocess mode (files the engine
core reads, with its own metrics, to answer /metrics: loom_router.observability.core_metrics).
What changes per token stays in the request's timer and reaches the shared histogram when the
request ends: a multiprocess observation costs a few microseconds, too much once per token.
"""

from __future__ import annotations

import logging
import time
import uuid
from bisect import bisect_left
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

from prometheus_client import CollectorRegistry, Counter, Histogram

from loom_router.observability.request_log import RequestSummary, log_request
from loom_router.observability.tgi_metrics import RequestTimes, TgiRequestMetrics
from loom_router.types import FinishReason

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
LENGTH_BUCKETS = tuple(float(2**i) for i in range(15))  # 1 .. 16384 tokens
# The routes that generate: TGI counts these in tgi_request_count.
GENERATION_PATHS = frozenset({"/", "/generate", "/generate_stream", "/v1/completions", "/v1/chat/completions",
                              "/v1/responses", "/v1/messages"})
SNAPSHOT_PREFIX = "/snapshots"
MAX_REQUEST_ID = 128  # characters of a client's X-Request-Id kept
FAILURE_BY_STATUS = {429: "overloaded", 499: "cancelled"}  # other 4xx: the request's fault ("validation")
SUCCESS_OUTCOMES = frozenset(reason.value for reason in FinishReason)

log = logging.getLogger("loom.metrics")


@dataclass(slots=True)
class HttpRecord:
    """What one HTTP request's handlers tell the middleware (through `_current_http`)."""

    arrival: float
    timer: RequestTimer | None = None
    snapshot_failure: str | None = None  # the error_type of a failed snapshot operation
    request_id: str = ""  # X-Request-Id: the client's, or one made here; in the response and the log line


# Set by MetricsMiddleware around each request, so the handlers' `start_request` and the
# snapshot error path reach their request's record without threading it through every call.
_current_http: ContextVar[HttpRecord | None] = ContextVar("loom_http_record", default=None)


def note_snapshot_failure(reason: str) -> None:
    """Called where a snapshot operation fails: its reason labels loom_snapshot_failures."""
    record = _current_http.get()
    if record is not None:
        record.snapshot_failure = reason


class FrontendMetrics:
    """A frontend's metrics, in a registry of its own (no global state)."""

    def __init__(self, tracer: Any = None, registry: CollectorRegistry | None = None) -> None:
        self.tracer = tracer  # loom_router.observability.tracing.RequestTracer, with --otlp-endpoint
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("loom_http_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.time_to_first_token = Histogram("loom_time_to_first_token_seconds", "Time to the first token",
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            "loom_inter_token_latency_seconds", "Time between two arrivals of one choice's tokens (tokens of one "
            "step arrive together)", buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.request_duration = Histogram("loom_request_duration_seconds", "End-to-end generation latency",
                                          buckets=LATENCY_BUCKETS, registry=r)
        self.input_length = Histogram("loom_request_input_tokens", "Prompt length in tokens",
                                      buckets=LENGTH_BUCKETS, registry=r)
        self.generated_length = Histogram("loom_request_generated_tokens", "Tokens generated per request",
                                          buckets=LENGTH_BUCKETS, registry=r)
        self.snapshot_operations = Counter("loom_snapshot_operations", "Snapshot operations by op and result",
                                           ["op", "result"], registry=r)
        self.snapshot_failures = Counter("loom_snapshot_failures", "Failed snapshot operations by op and reason",
                                         ["op", "reason"], registry=r)
        self.tgi = TgiRequestMetrics(r)

    def bind_limits(self, max_input_tokens: int, max_total_tokens: int) -> None:
        """The length histograms' buckets, once the engine core told the limits."""
        self.tgi.bind_limits(max_input_tokens, max_total_tokens)

    def new_timer(self, num_input_tokens: int) -> RequestTimer:
        """The timer of a generation about to be submitted (its first tokens may arrive before
        the submission returns)."""
        record = _current_http.get()
        timer = RequestTimer(self, None, num_input_tokens, record.arrival if record else None)
        timer.http_request_id = record.request_id if record else None
        return timer

    def start_request(self, timer: RequestTimer, stream: Any, engine: Any = None) -> RequestTimer:
        """The generation was admitted: its timer follows its stream, tied to the HTTP request."""
        timer._stream = stream
        self.input_length.observe(timer.num_input_tokens)
        if engine is not None:
            self.bind_limits(engine.max_input_tokens, engine.max_total_tokens)
        self.tgi.on_lengths(timer.num_input_tokens, getattr(stream, "max_new_tokens", None))
        record = _current_http.get()
        if record is not None:
            record.timer = timer
        return timer

    def on_http_end(self, scope: dict[str, Any], record: HttpRecord, status: int) -> None:
        path = scope.get("path", "")
        if _is_generation(scope):
            self._count_generation(record, status)
        elif path.startswith(SNAPSHOT_PREFIX) and "route" in scope:  # a snapshot route (not refused at the door)
            op = _snapshot_op(scope)
            self.snapshot_operations.labels(op=op, result="ok" if status < 400 else "error").inc()
            if status >= 400:
                self.snapshot_failures.labels(op=op, reason=record.snapshot_failure or str(status)).inc()

    def _count_generation(self, record: HttpRecord, status: int) -> None:
        timer = record.timer
        if timer is None:  # refused before it reached the engine
            if status >= 400:
                self.tgi.on_failure(_refusal(status))
            return
        timer.finish()  # idempotent; a stream the client left may not have closed yet
        if timer.succeeded:
            self.tgi.on_success(timer.times(), timer.num_generated)
        else:
            self.tgi.on_failure("generation" if timer.outcome == "error" else "cancelled")


def observe_many(histogram: Histogram, bucket_counts: list[int], total: float) -> None:
    """Add observations counted per bucket (bucket_counts[i]: observations in bucket i, the last
    one +Inf) and summing to `total`, as that many `observe` calls would: one write per bucket.
    Reads prometheus_client's Histogram internals (`_buckets`, `_sum`); a unit test checks it
    against `observe`."""
    for bucket, count in zip(histogram._buckets, bucket_counts):  # type: ignore[attr-defined]
        if count:
            bucket.inc(count)
    histogram._sum.inc(total)  # type: ignore[attr-defined]


def _refusal(status: int) -> str:
    """TGI's failure label for a generation refused before it reached the engine."""
    return FAILURE_BY_STATUS.get(status, "validation" if 400 <= status < 500 else "generation")


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

    __slots__ = ("_metrics", "_stream", "num_input_tokens", "_arrival", "_start", "_first_token", "_end",
                 "_itl_counts", "_itl_sum", "num_generated", "http_request_id")

    def __init__(self, metrics: FrontendMetrics, stream: Any = None, num_input_tokens: int = 0,
                 arrival: float | None = None) -> None:
        self._metrics = metrics
        self._stream = stream
        self.num_input_tokens = num_input_tokens
        self._start = time.monotonic()
        self._arrival = arrival if arrival is not None else self._start
        self._first_token: float | None = None
        self._end: float | None = None
        self._itl_counts = [0] * (len(TOKEN_LATENCY_BUCKETS) + 1)  # the inter-token latencies, per bucket
        self._itl_sum = 0.0
        self.num_generated = 0
        self.http_request_id: str | None = None  # X-Request-Id of the HTTP request it serves

    def on_tokens(self, index: int, count: int, now: float, gap: float | None) -> None:
        """`count` new tokens of choice `index` arrived at `now` (monotonic), `gap` after its last."""
        if self._first_token is None:
            self._first_token = now
            self._metrics.time_to_first_token.observe(now - self._start)
        if gap is not None:
            self._itl_counts[bisect_left(TOKEN_LATENCY_BUCKETS, gap)] += 1
            self._itl_sum += gap
        self.num_generated += count

    @property
    def outcome(self) -> str | None:
        return getattr(self._stream, "outcome", None)

    @property
    def succeeded(self) -> bool:
        """Every choice finished (the stream closed) by a finish reason, not an error or a cancel."""
        return bool(getattr(self._stream, "closed", False)) and self.outcome in SUCCESS_OUTCOMES

    def times(self) -> RequestTimes:
        end = self._end if self._end is not None else time.monotonic()
        validated = getattr(self._stream, "submitted_at", self._start)
        return RequestTimes(self._arrival, validated, getattr(self._stream, "scheduled_at", None), end)

    def finish(self) -> None:
        """Records end-to-end latency, length and the log line once, however the request ended."""
        if self._end is not None:
            return
        self._end = time.monotonic()
        observe_many(self._metrics.inter_token_latency, self._itl_counts, self._itl_sum)
        self._metrics.request_duration.observe(self._end - self._start)
        self._metrics.generated_length.observe(self.num_generated)
        times = self.times()
        summary = RequestSummary(
            request_id=getattr(self._stream, "group_id", None),
            http_request_id=self.http_request_id,
            num_input_tokens=self.num_input_tokens,
            num_generated_tokens=self.num_generated,
            queue_s=(times.scheduled - times.validated) if times.scheduled is not None else None,
            ttft_s=(self._first_token - self._arrival) if self._first_token is not None else None,
            total_s=self._end - self._arrival,
            finish_reason=self.outcome if self.succeeded else (self.outcome or "cancelled"),
        )
        log_request(summary)
        if self._metrics.tracer is not None:
            self._metrics.tracer.record(summary, times)


def request_id_of(scope: dict[str, Any]) -> str:
    """The client's X-Request-Id when it is a short printable token, else a new one (as vLLM's)."""
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id":
            text = value.decode("latin-1")
            if 0 < len(text) <= MAX_REQUEST_ID and text.isascii() and text.isprintable() and " " not in text:
                return text
            break
    return uuid.uuid4().hex


class MetricsMiddleware:
    """Counts every HTTP request by its route template and response status, and TGI's request
    counts by outcome (plain ASGI, so streaming responses and disconnect detection pass through
    untouched; for a stream, the app returns once its last byte went out)."""

    def __init__(self, app: Any, metrics: FrontendMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 500}
        record = HttpRecord(arrival=time.monotonic(), request_id=request_id_of(scope))
        if _is_generation(scope):
            self.metrics.tgi.on_arrival()

        async def send_and_record(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", record.request_id.encode())]
            await send(message)

        token = _current_http.set(record)
        try:
            await self.app(scope, receive, send_and_record)
        finally:
            _current_http.reset(token)
            code = status["code"]
            self.metrics.requests.labels(route=_route_label(scope, code), status=str(code)).inc()
            try:
                self.metrics.on_http_end(scope, record, code)
            except Exception:  # metrics must never fail a request
                log.exception("recording the metrics of %s failed", scope.get("path"))


def _route_label(scope: dict[str, Any], status: int) -> str:
    """The route's path template; FastAPI's own pages (/docs, /openapi.json) and the playground's
    files by their path when served; anything else that matched no route is "unmatched"."""
    path = getattr(scope.get("route"), "path", None)
    if path:
        return str(path)
    return str(scope["path"]) if "endpoint" in scope and status < 400 else "unmatched"
