"""The engine core's metrics, and /metrics for the whole router.

The core records once per step (TGI's batch metrics, each shard rank's step time) and reads the
engine's counters and gauges (`EngineStats`) at scrape time; the frontends' request metrics come
from prometheus_client's multiprocess files (or, in one process, their registries). `render` puts
all of them in one exposition, TGI's counters under their exact names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loom_router.observability.metrics import TOKEN_LATENCY_BUCKETS
from loom_router.observability.tgi_metrics import EXACT_COUNTERS, TgiBatchMetrics, render_exact, tgi_gauges
from loom_router.types import EngineStats, StepRecord


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
        yield _counter("loom_steps_planned_ahead", "Engine steps planned and sent while the step before ran "
                       "(--overlap-steps): the rest waited for the outputs of the one before", s.steps_planned_ahead)
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
        yield from _per_adapter(s)
        yield _gauge("loom_host_blocks_total", "Host-RAM swap pool blocks", s.num_host_blocks_total)
        yield _gauge("loom_host_blocks_used", "Host-RAM swap pool blocks holding swapped KV", s.num_host_blocks_used)
        healthy = GaugeMetricFamily("loom_shard_healthy", "1 when the shard rank answered the last health check",
                                    labels=["rank"])
        for rank, ok in enumerate(s.shard_healthy):
            healthy.add_metric([str(rank)], 1.0 if ok else 0.0)
        yield healthy
        yield from tgi_gauges(s.num_running, s.num_waiting, s.num_blocks_used * s.block_size,
                              s.max_batch_total_tokens)


def _per_adapter(s: EngineStats) -> Iterator[CounterMetricFamily]:
    for name, doc, counts in (
            ("loom_lora_requests", "Requests admitted per LoRA adapter", s.adapter_requests),
            ("loom_lora_prompt_tokens", "Prompt tokens of the requests per LoRA adapter", s.adapter_prompt_tokens),
            ("loom_lora_generated_tokens", "Tokens generated per LoRA adapter", s.adapter_generated_tokens)):
        family = CounterMetricFamily(name, doc, labels=["adapter"])
        for adapter, count in sorted(counts.items()):
            family.add_metric([adapter], count)
        yield family


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


class _Families:
    """Metric families already collected, as generate_latest wants them (a `collect()`)."""

    def __init__(self, families: Sequence[Metric]) -> None:
        self._families = families

    def collect(self) -> Sequence[Metric]:
        return self._families


class CoreMetrics:
    """The engine core's metrics, in a registry of its own, and the router's whole exposition."""

    def __init__(self, read_stats: Callable[[], EngineStats] | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.shard_step = Histogram("loom_shard_step_seconds", "One step on one shard rank, as the router waits",
                                    ["rank"], buckets=TOKEN_LATENCY_BUCKETS + (10.24, 30.0), registry=r)
        self._shard_step_by_rank: list[Any] = []
        self.shard_idle = Histogram("loom_shard_idle_seconds", "How long rank 0 waited for its next step while "
                                    "the router had work (none while a step launched ahead computes): near zero when "
                                    "the router keeps the device fed",
                                    buckets=(0.0001, 0.00025, 0.0005, *TOKEN_LATENCY_BUCKETS, 10.24, 30.0), registry=r)
        self.tgi = TgiBatchMetrics(r)
        # Requests a frontend took with it when it died: TGI's failures, counted here (summed with
        # the frontends' own at render).
        self.request_failure = Counter("tgi_request_failure", "Number of failed requests", ["err"], registry=r)
        if read_stats is not None:
            r.register(EngineStatsCollector(read_stats))
        # The frontends' metrics: a MultiProcessCollector over their files, or their registries.
        self.frontend_sources: list[Any] = []

    def bind_engine(self, engine: Any) -> None:
        """Follow the engine's steps (TGI's batch metrics, per-rank step time)."""
        engine.step_observers.append(self.on_step)

    def on_requests_lost(self, count: int) -> None:
        self.request_failure.labels("generation").inc(count)

    def on_step(self, step: StepRecord) -> None:
        self.tgi.on_batch(step.method, step.ok, step.duration_s, step.forward_s)
        by_rank = self._shard_step_by_rank
        while len(by_rank) < len(step.rank_total_s):  # each rank's child, looked up once
            by_rank.append(self.shard_step.labels(rank=str(len(by_rank))))
        for child, seconds in zip(by_rank, step.rank_total_s):
            child.observe(seconds)
        if step.idle_s is not None:
            self.shard_idle.observe(step.idle_s)

    def render(self) -> tuple[bytes, str]:
        """The exposition of every process's metrics and its content type."""
        families: list[Metric] = list(self.registry.collect())
        for source in self.frontend_sources:
            families += source.collect()
        exact = merged([family for family in families if family.name in EXACT_COUNTERS])
        rest = [family for family in families if family.name not in EXACT_COUNTERS]
        return generate_latest(_Families(rest)) + render_exact(exact).encode(), CONTENT_TYPE_LATEST  # type: ignore[arg-type]


def merged(families: Sequence[Metric]) -> list[Metric]:
    """Families of one name from several sources (the core's registry, the frontends' files) as one,
    each sample's values summed."""
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    first: dict[str, Metric] = {}
    for family in families:
        first.setdefault(family.name, family)
        by_sample = values.setdefault(family.name, {})
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            by_sample[key] = by_sample.get(key, 0.0) + sample.value
    out = []
    for name, family in first.items():
        metric = Metric(name, family.documentation, family.type)
        for (sample_name, labels), value in values[name].items():
            metric.add_sample(sample_name, dict(labels), value)
        out.append(metric)
    return out
