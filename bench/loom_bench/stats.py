"""What a run measured: throughput, latency percentiles (TTFT, TPOT, ITL, end to end), errors,
and goodput (requests per second that met every SLO given with --goodput)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from loom_bench.backends import RequestResult

PERCENTILES = (50, 90, 99)
SLO_METRICS = ("ttft", "tpot", "e2el")  # --goodput keys, in milliseconds


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def distribution_ms(values_s: list[float]) -> dict[str, float | None]:
    if not values_s:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    ms = [v * 1000.0 for v in values_s]
    return {"mean": sum(ms) / len(ms), **{f"p{q}": percentile(ms, q) for q in PERCENTILES}}


@dataclass(slots=True)
class Summary:
    server: str
    num_requests: int
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests per second
    output_throughput: float  # output tokens per second
    per_request_output_tok_s: float | None  # mean of each request's output tokens / its latency
    goodput: float | None  # requests per second meeting every SLO; None without --goodput
    ttft_ms: dict[str, float | None] = field(default_factory=dict)
    tpot_ms: dict[str, float | None] = field(default_factory=dict)
    itl_ms: dict[str, float | None] = field(default_factory=dict)
    e2el_ms: dict[str, float | None] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)  # message -> count

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def meets(result: RequestResult, slo_ms: dict[str, float]) -> bool:
    measured = {"ttft": result.ttft_s, "tpot": result.tpot_s or 0.0, "e2el": result.latency_s}
    return result.success and all(measured[key] * 1000.0 <= limit for key, limit in slo_ms.items())


def summarize(server: str, results: list[RequestResult], duration_s: float,
              slo_ms: dict[str, float] | None) -> Summary:
    ok = [r for r in results if r.success]
    duration_s = max(duration_s, 1e-9)
    per_request = [r.output_tokens / r.latency_s for r in ok if r.latency_s > 0]
    return Summary(
        server=server,
        num_requests=len(results),
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration_s,
        total_input_tokens=sum(r.prompt_tokens for r in ok),
        total_output_tokens=sum(r.output_tokens for r in ok),
        request_throughput=len(ok) / duration_s,
        output_throughput=sum(r.output_tokens for r in ok) / duration_s,
        per_request_output_tok_s=sum(per_request) / len(per_request) if per_request else None,
        goodput=sum(meets(r, slo_ms) for r in results) / duration_s if slo_ms else None,
        ttft_ms=distribution_ms([r.ttft_s for r in ok]),
        tpot_ms=distribution_ms([t for r in ok if (t := r.tpot_s) is not None]),
        itl_ms=distribution_ms([gap for r in ok for gap in r.itl_s]),
        e2el_ms=distribution_ms([r.latency_s for r in ok]),
        errors=dict(Counter(r.error for r in results if not r.success).most_common(5)),
    )


def ratios(base: Summary, other: Summary) -> dict[str, float | None]:
    """other / base for the numbers that compare servers run through the same requests."""
    out: dict[str, float | None] = {"per_request_output_tok_s": _ratio(other.per_request_output_tok_s,
                                                                       base.per_request_output_tok_s)}
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        for stat in ("mean", "p50", "p90", "p99"):
            out[f"{name}.{stat}"] = _ratio(getattr(other, name)[stat], getattr(base, name)[stat])
    return out


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def parse_goodput(items: list[str]) -> dict[str, float]:
    """`ttft:500 tpot:50` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slo: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key not in SLO_METRICS:
            raise ValueError(f"--goodput takes KEY:MS with KEY in {', '.join(SLO_METRICS)}; got {item!r}")
        slo[key] = float(value)
    return slo
