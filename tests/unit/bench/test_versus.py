"""The Loom-vs-llama.cpp table and target checks, from hand-made measures."""

from __future__ import annotations

import pytest

from loom_bench import datasets
from loom_bench.backends import RequestResult
from loom_bench.stats import summarize
from loom_bench.versus import (
    LOOM,
    PEER,
    TARGETS,
    Measure,
    Pair,
    Target,
    render_table,
    schedule,
    span,
    verdicts,
)


def _pair(concurrency: int, round_: int, loom: tuple[float, ...], peer: tuple[float, ...]) -> Pair:
    """(tokens/s, TTFT p50 ms, ITL p50 ms[, CPU ms per token]) for each server."""
    def measure(values: tuple[float, ...]) -> Measure:
        return Measure(concurrency, round_, *values[:3], failed=0, cpu_ms_per_token=(values[3:] or (None,))[0])
    return Pair(measure(loom), measure(peer))


PAIRS = [
    _pair(1, 0, (100.0, 100.0, 7.0, 10.0), (80.0, 450.0, 8.0, 25.0)),  # 1.25x tokens/s, 4.5x TTFT, 2.5x CPU
    _pair(1, 1, (90.0, 150.0, 7.5, 12.5), (80.0, 420.0, 8.5, 25.0)),  # 1.125x: below 1.2x, 2.8x TTFT, 2x CPU
    _pair(8, 0, (400.0, 500.0, 20.0), (120.0, 3600.0, 40.0)),  # 3.33x
    _pair(8, 1, (390.0, 520.0, 21.0), (125.0, 3400.0, 39.0)),  # 3.12x
]


def test_span_is_the_range_of_defined_values() -> None:
    assert span([3.0, 1.0, 2.0], ".1f") == "1.0-3.0"
    assert span([2.0, 2.04], ".1f") == "2.0"
    assert span([None, 5.0], ".0f") == "5"
    assert span([None], ".1f") == "-"


def test_table_has_one_row_per_concurrency_with_ranges_over_rounds() -> None:
    lines = render_table(PAIRS).splitlines()
    assert lines[0].startswith("| concurrency | llama.cpp out tokens/s | Loom out tokens/s | Loom / llama.cpp")
    assert lines[2] == ("| 1 | 80.0 | 90.0-100.0 | 1.12-1.25x | 420-450 ms / 100-150 ms | 8.0-8.5 ms / 7.0-7.5 ms "
                        "| 25.00 / 10.00-12.50 | 2.00-2.50x |")
    assert lines[3].startswith("| 8 | 120.0-125.0 | 390.0-400.0 | 3.12-3.33x | 3400-3600 ms / 500-520 ms |")
    assert lines[3].endswith("| - / - | -x |")  # no CPU times measured
    assert len(lines) == 4


def test_ratios_pair_servers_within_a_round() -> None:
    assert PAIRS[0].throughput_ratio == 1.25 and PAIRS[0].ttft_ratio == 4.5
    assert Pair(Measure(1, 0, 10.0, None, None, 1), Measure(1, 0, 0.0, 5.0, None, 1)).throughput_ratio is None


def test_a_target_is_met_only_when_every_round_meets_it() -> None:
    by_name = {v.target: v for v in verdicts(PAIRS, (Target(1, 1.2), Target(8, 3.0), Target(32, 4.0)))}
    assert by_name["concurrency 1: Loom / llama.cpp tokens/s >= 1.2x"].met is False  # round 2 is 1.125x
    assert by_name["concurrency 8: Loom / llama.cpp tokens/s >= 3x"].met is True
    assert by_name["concurrency 32: Loom / llama.cpp tokens/s >= 4x"].met is None  # not measured
    assert by_name["concurrency 1: llama.cpp / Loom TTFT p50 >= 3x"].met is False  # 2.8x in round 2
    assert by_name["concurrency 8: llama.cpp / Loom TTFT p50 >= 3x"].met is True
    assert by_name["concurrency 1: Loom / llama.cpp tokens/s >= 1.2x"].measured == "1.25x, 1.12x"


def test_the_issue_targets() -> None:
    assert TARGETS == (Target(1, 1.5), Target(8, 3.5), Target(32, 5.0))
    assert all(t.min_ttft_ratio == 3.0 for t in TARGETS)


def test_measure_takes_throughput_and_medians_from_a_summary() -> None:
    results = [RequestResult(True, "s", 10, 5, ttft_s=t, latency_s=1.0, itl_s=[0.01, 0.03]) for t in (0.1, 0.3)]
    measure = Measure.of(summarize("loom", results, duration_s=2.0, slo_ms=None), 8, 1)
    assert (measure.concurrency, measure.round, measure.failed) == (8, 1, 0)
    assert measure.output_tok_s == 5.0  # 10 tokens in 2 s
    assert abs(measure.ttft_p50_ms - 200.0) < 1e-9 and abs(measure.itl_p50_ms - 20.0) < 1e-9
    assert measure.cpu_ms_per_token is None
    with_cpu = Measure.of(summarize("loom", results, duration_s=2.0, slo_ms=None), 8, 1, cpu_s=0.5)
    assert with_cpu.cpu_ms_per_token == 50.0  # 500 ms over 10 tokens


def test_schedule_alternates_the_servers_and_never_repeats_prompts() -> None:
    specs = schedule([1, 8, 32], rounds=2)
    assert [(s.round, s.concurrency) for s in specs] == [(0, 1), (0, 8), (0, 32), (1, 1), (1, 8), (1, 32)]
    assert [s.order[0] for s in specs] == [LOOM, PEER, LOOM, PEER, LOOM, PEER]
    for concurrency in (1, 8, 32):  # over two rounds each concurrency sees both orders
        assert {s.order for s in specs if s.concurrency == concurrency} == {(LOOM, PEER), (PEER, LOOM)}
    prompts = [r.prompt for s in specs for r in datasets.random_requests(2 * s.concurrency, 150, 128, 0.0, s.seed)]
    assert len(set(prompts)) == len(prompts)


def test_schedule_refuses_what_it_cannot_pair() -> None:
    for concurrencies, rounds in (([1, 1], 2), ([0], 1), ([1], 0)):
        with pytest.raises(ValueError):
            schedule(concurrencies, rounds)
