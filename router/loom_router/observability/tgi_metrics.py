"""text-generation-inference's metrics, by TGI's names, label sets and buckets, so TGI's
dashboards and alerts work on Loom unchanged (TGI router/src/server.rs and infer/).

TGI exports through the Rust `metrics` crate, whose counters carry no `_total` suffix
(`tgi_request_count 3`); prometheus_client always appends one, so these counters (recorded
as prometheus_client Counters, in every process) are rendered by `render_exact` instead.
The frontends record the request metrics, the engine core the batch metrics.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.utils import floatToGoString

# TGI: 35 buckets, a geometric sequence from 0.0001 s times 1.5 (for every `*duration`).
DURATION_BUCKETS = tuple(0.0001 * 1.5 ** (k + 1) for k in range(35))
NUM_LENGTH_BUCKETS = 100  # TGI: max_input_tokens / 100 * (x + 1), and max_total_tokens for outputs
BATCH_METHODS = ("prefill", "decode")
# TGI's `err` label values; Loom adds "cancelled" for a client that went away mid-generation.
FAILURE_KINDS = ("validation", "overloaded", "generation", "incomplete_generation", "cancelled")


def length_buckets(max_tokens: int) -> tuple[float, ...]:
    return tuple(max_tokens / NUM_LENGTH_BUCKETS * (x + 1) for x in range(NUM_LENGTH_BUCKETS))


# Counters TGI exports without `_total` (rendered by `render_exact`).
EXACT_COUNTERS = frozenset({"tgi_request_count", "tgi_request_success", "tgi_request_failure",
                            "tgi_batch_inference_count", "tgi_batch_inference_success",
                            "tgi_batch_inference_failure"})


def render_exact(families: Sequence[Metric]) -> str:
    """Counter families in the text format under their exact names (no `_total`), as TGI's."""
    lines: list[str] = []
    for family in families:
        lines += [f"# HELP {family.name} {family.documentation}", f"# TYPE {family.name} counter"]
        for sample in sorted(family.samples, key=lambda s: sorted(s.labels.items())):
            if not sample.name.endswith("_total"):
                continue  # `_created`
            pairs = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            lines.append(f"{family.name}{{{pairs}}} {floatToGoString(sample.value)}" if pairs
                         else f"{family.name} {floatToGoString(sample.value)}")
    return "\n".join(lines) + "\n" if lines else ""


@dataclass(slots=True)
class RequestTimes:
    """One request's timeline in perf_counter seconds, as TGI splits it."""

    arrival: float
    validated: float  # submitted to the engine
    scheduled: float | None  # first step that ran it
    end: float


def _duration(registry: CollectorRegistry, name: str, doc: str, labels: Sequence[str] = ()) -> Histogram:
    return Histogram(name, doc, labels, buckets=DURATION_BUCKETS, registry=registry)


class TgiRequestMetrics:
    """TGI's request metrics, recorded by the frontends. The length histograms' buckets depend on
    the model's limits, known once the engine core answered: `bind_limits` creates them."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        r = registry
        self.request_count = Counter("tgi_request_count", "Total number of requests", registry=r)
        self.request_success = Counter("tgi_request_success", "Number of successful requests", registry=r)
        self.request_failure = Counter("tgi_request_failure", "Number of failed requests", ["err"], registry=r)
        for kind in FAILURE_KINDS:
            self.request_failure.labels(kind)  # present from the first scrape, as rate() needs
        self.request_duration = _duration(r, "tgi_request_duration", "Request end-to-end latency (s)")
        self.validation_duration = _duration(r, "tgi_request_validation_duration", "Request validation time (s)")
        self.queue_duration = _duration(r, "tgi_request_queue_duration", "Time spent in the queue (s)")
        self.inference_duration = _duration(r, "tgi_request_inference_duration", "Request inference time (s)")
        self.mean_time_per_token = _duration(r, "tgi_request_mean_time_per_token_duration",
                                             "Mean time per generated token (s)")
        self.input_length: Histogram | None = None
        self.generated_tokens: Histogram | None = None
        self.max_new_tokens: Histogram | None = None

    def bind_limits(self, max_input_tokens: int, max_total_tokens: int) -> None:
        if self.input_length is not None or max_total_tokens <= 0:
            return
        r = self._registry
        self.input_length = Histogram("tgi_request_input_length", "Input tokens per request",
                                      buckets=length_buckets(max_input_tokens), registry=r)
        self.generated_tokens = Histogram("tgi_request_generated_tokens", "Generated tokens per request",
                                          buckets=length_buckets(max_total_tokens), registry=r)
        self.max_new_tokens = Histogram("tgi_request_max_new_tokens", "max_new_tokens per request",
                                        buckets=length_buckets(max_total_tokens), registry=r)

    def on_arrival(self) -> None:
        self.request_count.inc()

    def on_failure(self, kind: str) -> None:
        self.request_failure.labels(kind).inc()

    def on_lengths(self, num_input_tokens: int, max_new_tokens: int | None) -> None:
        if self.input_length is not None:
            self.input_length.observe(num_input_tokens)
        if self.max_new_tokens is not None and max_new_tokens is not None:
            self.max_new_tokens.observe(max_new_tokens)

    def on_success(self, times: RequestTimes, num_generated: int) -> None:
        """TGI records the durations of successful requests only."""
        self.request_success.inc()
        scheduled = times.scheduled if times.scheduled is not None else times.end
        inference = times.end - scheduled
        self.request_duration.observe(times.end - times.arrival)
        self.validation_duration.observe(times.validated - times.arrival)
        self.queue_duration.observe(scheduled - times.validated)
        self.inference_duration.observe(inference)
        if num_generated > 0:
            self.mean_time_per_token.observe(inference / num_generated)
        if self.generated_tokens is not None:
            self.generated_tokens.observe(num_generated)


class TgiBatchMetrics:
    """TGI's batch metrics, recorded by the engine core once per step."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.count = Counter("tgi_batch_inference_count", "Inference calls per method", ["method"], registry=r)
        self.success = Counter("tgi_batch_inference_success", "Successful inference calls per method", ["method"],
                               registry=r)
        self.failure = Counter("tgi_batch_inference_failure", "Failed inference calls per method", ["method"],
                               registry=r)
        for method in BATCH_METHODS:
            self.count.labels(method)  # present from the first scrape
        self.inference_duration = _duration(r, "tgi_batch_inference_duration",
                                            "Batch inference time as the router sees it (s)", ["method"])
        self.forward_duration = _duration(r, "tgi_batch_forward_duration", "Batch forward time on the shards (s)",
                                          ["method"])

        # Each method's children, looked up once: `labels()` costs more than the update it serves.
        self._by_method = {method: _MethodMetrics(self.count.labels(method), self.success.labels(method),
                                                  self.failure.labels(method), self.inference_duration.labels(method),
                                                  self.forward_duration.labels(method))
                           for method in BATCH_METHODS}

    def on_batch(self, method: str, ok: bool, duration_s: float, forward_s: float | None) -> None:
        metrics = self._by_method[method]
        metrics.count.inc()
        if not ok:
            metrics.failure.inc()
            return
        metrics.success.inc()
        metrics.inference_duration.observe(duration_s)
        if forward_s is not None:
            metrics.forward_duration.observe(forward_s)


@dataclass(frozen=True, slots=True)
class _MethodMetrics:
    count: Any
    success: Any
    failure: Any
    inference_duration: Any
    forward_duration: Any


def tgi_gauges(num_running: int, num_waiting: int, batch_max_tokens: int,
               max_batch_total_tokens: int) -> Iterator[Metric]:
    """TGI's gauges, from the engine's state at scrape time."""
    yield GaugeMetricFamily("tgi_batch_current_size", "Current batch size", value=num_running)
    yield GaugeMetricFamily("tgi_batch_current_max_tokens",
                            "Tokens the current batch holds KV blocks for", value=batch_max_tokens)
    yield GaugeMetricFamily("tgi_queue_size", "Current queue size", value=num_waiting)
    yield GaugeMetricFamily("tgi_batch_max_total_tokens", "Maximum tokens the KV cache holds",
                            value=max_batch_total_tokens)
