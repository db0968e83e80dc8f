"""The frontend's metrics keep a request's inter-token latencies locally and add them to the shared
histogram when the request ends (a multiprocess observation per token costs too much)."""

from __future__ import annotations

from bisect import bisect_left

from prometheus_client import CollectorRegistry, Histogram

from loom_router.observability.metrics import TOKEN_LATENCY_BUCKETS, FrontendMetrics, observe_many


def samples(registry: CollectorRegistry, name: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in registry.collect() if family.name == name for s in family.samples
            if not s.name.endswith("_created")}


def test_observe_many_adds_what_as_many_observes_would() -> None:
    values = [0.0004, 0.001, 0.003, 0.003, 0.07, 9.0, 0.02]
    one, many = CollectorRegistry(), CollectorRegistry()
    by_one = Histogram("h", "x", buckets=TOKEN_LATENCY_BUCKETS, registry=one)
    by_many = Histogram("h", "x", buckets=TOKEN_LATENCY_BUCKETS, registry=many)
    for value in values:
        by_one.observe(value)
    counts = [0] * (len(TOKEN_LATENCY_BUCKETS) + 1)
    for value in values:
        counts[bisect_left(TOKEN_LATENCY_BUCKETS, value)] += 1
    observe_many(by_many, counts, sum(values))
    assert samples(many, "h") == samples(one, "h")


def test_a_request_timer_reports_its_gaps_once_it_finishes() -> None:
    metrics = FrontendMetrics()
    timer = metrics.new_timer(num_input_tokens=5)
    timer.on_tokens(0, 1, 10.0, None)  # the first token: time to first token, no gap
    timer.on_tokens(0, 3, 10.004, 0.004)  # three tokens of one step arriving together: one gap
    timer.on_tokens(0, 1, 10.010, 0.006)
    count = ("loom_inter_token_latency_seconds_count", ())
    assert samples(metrics.registry, "loom_inter_token_latency_seconds")[count] == 0
    timer.finish()
    itl = samples(metrics.registry, "loom_inter_token_latency_seconds")
    assert itl[count] == 2 and abs(itl[("loom_inter_token_latency_seconds_sum", ())] - 0.010) < 1e-9
    assert samples(metrics.registry, "loom_time_to_first_token_seconds")[("loom_time_to_first_token_seconds_count", ())] == 1
    assert timer.num_generated == 5
