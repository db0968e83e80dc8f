"""text-generation-inference's metrics, by TGI's names, label sets and buckets, so TGI's
dashboards and alerts work on Loom unchanged (TGI router/src/server.rs and infer/).

TGI exports through the Rust `metrics` crate, whose counters carry no `_total` suffix
(`tgi_request_count 3`); prometheus_client always appends one, so these counters are
rendered by `ExactCounters` instead, in the same text format.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Histogram
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


class ExactCounters:
    """Counters exported under their exact names (no `_total`), as TGI's are."""

    def __init__(self) -> None:
        self._docs: dict[str, tuple[str, tuple[str, ...]]] = {}
        self._values: dict[str, dict[tuple[str, ...], float]] = {}

    def declare(self, name: str, doc: str, labels: Sequence[str] = ()) -> None:
        self._docs[name] = (doc, tuple(labels))
        self._values[name] = {}

    def inc(self, name: str, *label_values: str, amount: float = 1.0) -> None:
        assert len(label_values) == len(self._docs[name][1]), name
        values = self._values[name]
        values[label_values] = values.get(label_values, 0.0) + amount

    def value(self, name: str, *label_values: str) -> float:
        return self._values[name].get(label_values, 0.0)

    def render(self) -> str:
        lines: list[str] = []
        for name, (doc, labels) in self._docs.items():
            lines += [f"# HELP {name} {doc}", f"# TYPE {name} counter"]
            for label_values, value in sorted(self._values[name].items()):
                pairs = ",".join(f'{k}="{v}"' for k, v in zip(labels, label_values))
                lines.append(f"{name}{{{pairs}}} {floatToGoString(value)}" if pairs
                             else f"{name} {floatToGoString(value)}")
        return "\n".join(lines) + "\n"


@dataclass(slots=True)
class RequestTimes:
    """One request's timeline in perf_counter seconds, as TGI splits it."""

    arrival: float
    validated: float  # submitted to the engine
    scheduled: float | None  # first step that ran it
    end: float


class TgiMetrics:
    """TGI's request and batch metrics. The length histograms' buckets depend on the
    model's limits, known once the engine started: `bind_limits` creates them."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self.counters = ExactCounters()
        self.counters.declare("tgi_request_count", "Total number of requests")
        self.counters.declare("tgi_request_success", "Number of successful requests")
        self.counters.declare("tgi_request_failure", "Number of failed requests", ["err"])
        self.counters.declare("tgi_batch_inference_count", "Inference calls per method", ["method"])
        self.counters.declare("tgi_batch_inference_success", "Successful inference calls per method", ["method"])
        self.counters.declare("tgi_batch_inference_failure", "Failed inference calls per method", ["method"])
        for name in ("tgi_request_count", "tgi_request_success"):
            self.counters.inc(name, amount=0.0)  # present from the first scrape, as rate() needs
        for method in BATCH_METHODS:
            self.counters.inc("tgi_batch_inference_count", method, amount=0.0)
        for kind in FAILURE_KINDS:
            self.counters.inc("tgi_request_failure", kind, amount=0.0)

        def duration(name: str, doc: str, labels: Sequence[str] = ()) -> Histogram:
            return Histogram(name, doc, labels, buckets=DURATION_BUCKETS, registry=registry)

        self.request_duration = duration("tgi_request_duration", "Request end-to-end latency (s)")
        self.validation_duration = duration("tgi_request_validation_duration", "Request validation time (s)")
        self.queue_duration = duration("tgi_request_queue_duration", "Time spent in the queue (s)")
        self.inference_duration = duration("tgi_request_inference_duration", "Request inference time (s)")
        self.mean_time_per_token = duration("tgi_request_mean_time_per_token_duration",
                                            "Mean time per generated token (s)")
        self.batch_inference_duration = duration("tgi_batch_inference_duration",
                                                 "Batch inference time as the router sees it (s)", ["method"])
        self.batch_forward_duration = duration("tgi_batch_forward_duration",
                                               "Batch forward time on the shards (s)", ["method"])
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
        self.counters.inc("tgi_request_count")

    def on_failure(self, kind: str) -> None:
        self.counters.inc("tgi_request_failure", kind)

    def on_lengths(self, num_input_tokens: int, max_new_tokens: int | None) -> None:
        if self.input_length is not None:
            self.input_length.observe(num_input_tokens)
        if self.max_new_tokens is not None and max_new_tokens is not None:
            self.max_new_tokens.observe(max_new_tokens)

    def on_success(self, times: RequestTimes, num_generated: int) -> None:
        """TGI records the durations of successful requests only."""
        self.counters.inc("tgi_request_success")
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

    def on_batch(self, method: str, ok: bool, duration_s: float, forward_s: float | None) -> None:
        self.counters.inc("tgi_batch_inference_count", method)
        if not ok:
            self.counters.inc("tgi_batch_inference_failure", method)
            return
        self.counters.inc("tgi_batch_inference_success", method)
        self.batch_inference_duration.labels(method=method).observe(duration_s)
        if forward_s is not None:
            self.batch_forward_duration.labels(method=method).observe(forward_s)


def tgi_gauges(num_running: int, num_waiting: int, batch_max_tokens: int,
               max_batch_total_tokens: int) -> Iterator[Metric]:
    """TGI's gauges, from the engine's state at scrape time."""
    yield GaugeMetricFamily("tgi_batch_current_size", "Current batch size", value=num_running)
    yield GaugeMetricFamily("tgi_batch_current_max_tokens",
                            "Tokens the current batch holds KV blocks for", value=batch_max_tokens)
    yield GaugeMetricFamily("tgi_queue_size", "Current queue size", value=num_waiting)
    yield GaugeMetricFamily("tgi_batch_max_total_tokens", "Maximum tokens the KV cache holds",
                            value=max_batch_total_tokens)
