"""Prometheus metrics of the router: HTTP and latency metrics recorded per request, and the
engine's counters and gauges read from `EngineStats` at scrape time. One registry per app."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loom_router.types import ChoiceEvent, EngineStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
LENGTH_BUCKETS = tuple(float(2**i) for i in range(15))  # 1 .. 16384 tokens


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


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


class RouterMetrics:
    """The router's metrics, in a registry of its own (no global state)."""

    def __init__(self, read_stats: Callable[[], EngineStats] | None = None) -> None:
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
        if read_stats is not None:
            r.register(EngineStatsCollector(read_stats))

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def start_request(self, num_input_tokens: int) -> RequestTimer:
        self.input_length.observe(num_input_tokens)
        return RequestTimer(self)


class RequestTimer:
    """Latency bookkeeping of one generation request, fed with its events."""

    __slots__ = ("_metrics", "_start", "_last_by_choice", "_num_generated", "_done")

    def __init__(self, metrics: RouterMetrics) -> None:
        self._metrics = metrics
        self._start = time.perf_counter()
        self._last_by_choice: dict[int, float] = {}
        self._num_generated = 0
        self._done = False

    def on_event(self, event: ChoiceEvent) -> None:
        now = time.perf_counter()
        if not self._last_by_choice:
            self._metrics.time_to_first_token.observe(now - self._start)
        last = self._last_by_choice.get(event.index)
        if last is not None:
            self._metrics.inter_token_latency.observe(now - last)
        self._last_by_choice[event.index] = now
        self._num_generated += 1

    def finish(self) -> None:
        """Records end-to-end latency and length once, whether the request completed or not."""
        if self._done:
            return
        self._done = True
        self._metrics.request_duration.observe(time.perf_counter() - self._start)
        self._metrics.generated_length.observe(self._num_generated)


class MetricsMiddleware:
    """Counts every HTTP request by its route template and response status (plain ASGI, so
    streaming responses and disconnect detection pass through untouched)."""

    def __init__(self, app: Any, metrics: RouterMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 500}

        async def send_and_record(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.labels(route=path, status=str(status["code"])).inc()
