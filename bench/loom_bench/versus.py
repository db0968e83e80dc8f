"""Loom against llama.cpp's server: the side-by-side table and its targets.

Each (concurrency, round) is measured once per server, the servers taking turns; the table
shows each number as the range over rounds, the ratios paired round by round (the two servers
of one round saw the same prompts), and a target is met only when every round meets it.
"""

from __future__ import annotations

from dataclasses import dataclass

from loom_bench.stats import Summary

LOOM = "loom"
PEER = "llama.cpp"


@dataclass(slots=True, frozen=True)
class Measure:
    """What one server did in one run (one concurrency, one round)."""

    concurrency: int
    round: int
    output_tok_s: float
    ttft_p50_ms: float | None
    itl_p50_ms: float | None
    failed: int
    # The server's CPU time (every process of it, from /proc) over the output tokens: steadier
    # than tokens/s on a shared machine, where others' load takes wall time but not this.
    cpu_ms_per_token: float | None = None

    @classmethod
    def of(cls, summary: Summary, concurrency: int, round_: int, cpu_s: float | None = None) -> Measure:
        tokens = summary.total_output_tokens
        cpu_ms = cpu_s * 1000.0 / tokens if cpu_s is not None and tokens > 0 else None
        return cls(concurrency, round_, summary.output_throughput, summary.ttft_ms.get("p50"),
                   summary.itl_ms.get("p50"), summary.failed, cpu_ms)


@dataclass(slots=True, frozen=True)
class Pair:
    """Both servers' measures of one (concurrency, round)."""

    loom: Measure
    peer: Measure

    def __post_init__(self) -> None:
        assert (self.loom.concurrency, self.loom.round) == (self.peer.concurrency, self.peer.round)

    @property
    def throughput_ratio(self) -> float | None:
        """Loom's output tokens/s over llama.cpp's: above 1, Loom is faster."""
        return _ratio(self.loom.output_tok_s, self.peer.output_tok_s)

    @property
    def cpu_ratio(self) -> float | None:
        """llama.cpp's CPU ms per output token over Loom's: above 1, Loom spends less."""
        return _ratio(self.peer.cpu_ms_per_token, self.loom.cpu_ms_per_token)

    @property
    def ttft_ratio(self) -> float | None:
        """llama.cpp's TTFT p50 over Loom's: above 1, Loom answers first."""
        return _ratio(self.peer.ttft_p50_ms, self.loom.ttft_p50_ms)


@dataclass(slots=True, frozen=True)
class Target:
    """Loom / llama.cpp output tokens/s at a concurrency, and llama.cpp / Loom TTFT p50."""

    concurrency: int
    min_throughput_ratio: float
    min_ttft_ratio: float = 3.0


# The CPU-speed targets against llama.cpp.
TARGETS = (Target(1, 1.5), Target(8, 3.5), Target(32, 5.0))


@dataclass(slots=True, frozen=True)
class Verdict:
    target: str  # e.g. "concurrency 8: tokens/s >= 3x"
    measured: str  # the per-round ratios
    met: bool | None  # None: not measured (or a ratio was undefined)


@dataclass(slots=True, frozen=True)
class RunSpec:
    """One (round, concurrency): its prompts' seed and which server goes first."""

    round: int
    concurrency: int
    seed: int  # fresh prompts per run, the same for both servers of the run
    order: tuple[str, str]


def schedule(concurrencies: list[int], rounds: int) -> list[RunSpec]:
    """Rounds of every concurrency, the servers' order alternating run by run (and round by
    round, so each concurrency sees both orders over two rounds); every run's seed distinct."""
    if len(set(concurrencies)) != len(concurrencies) or any(c < 1 for c in concurrencies) or rounds < 1:
        raise ValueError("concurrencies must be distinct and positive, rounds at least 1")
    specs = []
    for round_ in range(rounds):
        for index, concurrency in enumerate(concurrencies):
            order = (LOOM, PEER) if (round_ + index) % 2 == 0 else (PEER, LOOM)
            specs.append(RunSpec(round_, concurrency, 1 + round_ * (max(concurrencies) + 1) + concurrency, order))
    return specs


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def span(values: list[float | None], fmt: str) -> str:
    """`lo-hi` of the defined values (one value when all equal); `-` when none is."""
    defined = [v for v in values if v is not None]
    if not defined:
        return "-"
    low, high = format(min(defined), fmt), format(max(defined), fmt)
    return low if low == high else f"{low}-{high}"


def by_concurrency(pairs: list[Pair]) -> dict[int, list[Pair]]:
    out: dict[int, list[Pair]] = {}
    for pair in sorted(pairs, key=lambda p: (p.loom.concurrency, p.loom.round)):
        out.setdefault(pair.loom.concurrency, []).append(pair)
    return out


def render_table(pairs: list[Pair]) -> str:
    """The issue's markdown table, one row per concurrency, each cell the range over rounds."""
    lines = [
        "| concurrency | llama.cpp out tokens/s | Loom out tokens/s | Loom / llama.cpp "
        "| TTFT p50 llama.cpp / Loom | ITL p50 llama.cpp / Loom "
        "| CPU ms per token llama.cpp / Loom | CPU ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for concurrency, rows in by_concurrency(pairs).items():
        peer, loom = [p.peer for p in rows], [p.loom for p in rows]
        lines.append(
            f"| {concurrency} | {span([m.output_tok_s for m in peer], '.1f')} "
            f"| {span([m.output_tok_s for m in loom], '.1f')} "
            f"| {span([p.throughput_ratio for p in rows], '.2f')}x "
            f"| {span([m.ttft_p50_ms for m in peer], '.0f')} ms / {span([m.ttft_p50_ms for m in loom], '.0f')} ms "
            f"| {span([m.itl_p50_ms for m in peer], '.1f')} ms / {span([m.itl_p50_ms for m in loom], '.1f')} ms "
            f"| {span([m.cpu_ms_per_token for m in peer], '.2f')} / {span([m.cpu_ms_per_token for m in loom], '.2f')} "
            f"| {span([p.cpu_ratio for p in rows], '.2f')}x |"
        )
    return "\n".join(lines)


def verdicts(pairs: list[Pair], targets: tuple[Target, ...] = TARGETS) -> list[Verdict]:
    """Each target met or not: throughput at its concurrency, TTFT at every measured one."""
    grouped = by_concurrency(pairs)
    out: list[Verdict] = []
    for target in targets:
        out.append(_verdict(f"concurrency {target.concurrency}: Loom / llama.cpp tokens/s >= "
                            f"{target.min_throughput_ratio:g}x",
                            [p.throughput_ratio for p in grouped.get(target.concurrency, [])],
                            target.min_throughput_ratio))
    ttft_floor = min((t.min_ttft_ratio for t in targets), default=3.0)
    for concurrency, rows in grouped.items():
        out.append(_verdict(f"concurrency {concurrency}: llama.cpp / Loom TTFT p50 >= {ttft_floor:g}x",
                            [p.ttft_ratio for p in rows], ttft_floor))
    return out


def _verdict(name: str, ratios: list[float | None], floor: float) -> Verdict:
    measured = ", ".join("-" if r is None else f"{r:.2f}x" for r in ratios) or "not measured"
    if not ratios or any(r is None for r in ratios):
        return Verdict(name, measured, None)
    return Verdict(name, measured, all(r >= floor for r in ratios if r is not None))


def render_verdicts(items: list[Verdict]) -> str:
    marks = {True: "met", False: "NOT met", None: "unknown"}
    return "\n".join(f"- {v.target}: {marks[v.met]} ({v.measured})" for v in items)
