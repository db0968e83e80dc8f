"""`loom-bench`: measure a serving endpoint the way `vllm bench serve` does.

    loom-bench --backend openai --concurrency 1,4,16 --num-prompts 64 --result-file out.json --plot out.png
    loom-bench --backend tgi --request-rate 2,8 --burstiness 0.5 --goodput ttft:500 tpot:50
    loom-bench --base-url http://a:3000 --compare http://b:3000     # side by side, with ratios
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loom_bench import datasets
from loom_bench.backends import BACKENDS, BackendOptions
from loom_bench.runner import Load, RunResult, run_load
from loom_bench.stats import Summary, parse_goodput, ratios, summarize

DATASETS = ("random", "shared-prefix", "multi-turn", "jsonl", "sharegpt")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loom-bench", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:3000", help="the server to measure")
    p.add_argument("--compare", metavar="URL2", help="a second server, sent the same requests alternately")
    p.add_argument("--backend", choices=sorted(BACKENDS), default="openai")
    p.add_argument("--model", help="`model` of OpenAI requests (default: none sent)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as `Authorization: Bearer` (default: $OPENAI_API_KEY; none: no header)")
    p.add_argument("--dataset-name", choices=DATASETS, default="random")
    p.add_argument("--dataset-path", type=Path, help="the jsonl or sharegpt file")
    p.add_argument("--num-prompts", type=int, default=100, help="requests per load level")
    p.add_argument("--random-input-len", type=int, default=128, help="prompt words (random, multi-turn turns)")
    p.add_argument("--random-output-len", type=int, default=64, help="tokens to generate")
    p.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths vary within ±ratio")
    p.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: words of each prefix")
    p.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct prefixes")
    p.add_argument("--num-turns", type=int, default=4, help="multi-turn: user turns per conversation")
    p.add_argument("--concurrency", default="", help="max requests in flight; a comma list sweeps")
    p.add_argument("--request-rate", default="inf", help="requests per second (inf: no pacing); a comma list sweeps")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals: 1 Poisson, <1 bursty")
    p.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS", help="SLOs: ttft:MS tpot:MS e2el:MS")
    p.add_argument("--ignore-eos", action="store_true", help="generate every requested token (OpenAI backends)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--result-file", type=Path, help="write the results as JSON")
    p.add_argument("--plot", type=Path, help="write a PNG of the sweep (needs loom-bench[plot])")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def load_requests(args: argparse.Namespace) -> list[datasets.BenchRequest]:
    n, out_len, seed = args.num_prompts, args.random_output_len, args.seed
    name = args.dataset_name
    if name in ("jsonl", "sharegpt") and args.dataset_path is None:
        raise ValueError(f"--dataset-name {name} needs --dataset-path")
    if args.dataset_path is not None and not args.dataset_path.is_file():
        raise ValueError(f"--dataset-path {args.dataset_path}: no such file")
    if name == "random":
        return datasets.random_requests(n, args.random_input_len, out_len, args.random_range_ratio, seed)
    if name == "shared-prefix":
        return datasets.shared_prefix_requests(n, args.prefix_len, args.random_input_len, out_len,
                                               args.num_prefixes, seed)
    if name == "multi-turn":
        return datasets.multi_turn_requests(n, args.num_turns, args.random_input_len, out_len, seed)
    if name == "jsonl":
        return datasets.jsonl_requests(args.dataset_path, n, out_len)
    return datasets.sharegpt_requests(args.dataset_path, n, out_len, seed)


def loads(args: argparse.Namespace) -> list[Load]:
    """Every combination of the listed concurrencies and rates (a sweep when more than one)."""
    concurrencies: list[int | None] = [int(c) for c in args.concurrency.split(",") if c.strip()] or [None]
    rates = [math.inf if r.strip() == "inf" else float(r) for r in args.request_rate.split(",") if r.strip()]
    if any(c is not None and c < 1 for c in concurrencies) or any(r <= 0 for r in rates):
        raise ValueError("--concurrency and --request-rate must be positive")
    return [Load(c, r, args.burstiness) for c in concurrencies for r in rates or [math.inf]]


def print_summary(summary: Summary) -> None:
    print(f"  {summary.server}: {summary.completed}/{summary.num_requests} ok, {summary.failed} failed, "
          f"{summary.duration_s:.2f} s")
    print(f"    requests/s {summary.request_throughput:.3f}   output tok/s {summary.output_throughput:.2f}   "
          f"in/out tokens {summary.total_input_tokens}/{summary.total_output_tokens}"
          + (f"   goodput {summary.goodput:.3f} req/s" if summary.goodput is not None else ""))
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        stats = getattr(summary, name)
        print(f"    {name:8} " + "  ".join(f"{k} {'-' if v is None else f'{v:.1f}'}" for k, v in stats.items()))
    for message, count in summary.errors.items():
        print(f"    error x{count}: {message}")


def print_ratios(values: dict[str, float | None], base: str, other: str) -> None:
    print(f"  ratios {other} / {base}:")
    print("    " + "  ".join(f"{k} {'-' if v is None else f'{v:.3f}'}" for k, v in values.items()))


def report(run: RunResult, servers: list[str], slo: dict[str, float]) -> dict[str, Any]:
    summaries = {s: summarize(s, run.by_server[s], run.duration_s, slo or None) for s in servers}
    print(f"== {run.load.label()} ==")
    for summary in summaries.values():
        print_summary(summary)
    entry: dict[str, Any] = {
        "load": {"label": run.load.label(), "concurrency": run.load.concurrency,
                 "request_rate": None if math.isinf(run.load.request_rate) else run.load.request_rate,
                 "burstiness": run.load.burstiness},
        "servers": {s: summary.to_json() for s, summary in summaries.items()},
    }
    if len(servers) == 2:
        entry["ratios"] = ratios(summaries[servers[0]], summaries[servers[1]])
        print_ratios(entry["ratios"], servers[0], servers[1])
    return entry


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be at least 1, not {args.num_prompts}")
    requests = load_requests(args)
    servers = [args.base_url.rstrip("/")] + ([args.compare.rstrip("/")] if args.compare else [])
    if len(set(servers)) < len(servers):
        raise ValueError(f"--compare names the --base-url server ({servers[0]}): compare two servers")
    slo = parse_goodput(args.goodput)
    opts = BackendOptions(args.model, args.ignore_eos, args.temperature)
    runs = []
    for load in loads(args):
        run = await run_load(requests, servers, BACKENDS[args.backend], opts, load, args.seed,
                             progress=not args.no_progress, timeout_s=args.timeout, api_key=args.api_key)
        runs.append(report(run, servers, slo))
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "api_key"}  # a secret
    return {"config": config, "runs": runs}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = asyncio.run(bench(args))
    except ValueError as error:
        print(f"loom-bench: {error}", file=sys.stderr)
        return 2
    if args.result_file:
        args.result_file.write_text(json.dumps(result, indent=2))
    if args.plot:
        from loom_bench.plot import plot_sweep

        plot_sweep(result["runs"], args.plot)
    failed = sum(s["failed"] for run in result["runs"] for s in run["servers"].values())
    return 1 if failed and failed == sum(s["num_requests"] for run in result["runs"]
                                        for s in run["servers"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
