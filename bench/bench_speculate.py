"""Prompt-lookup speculative decoding (`--speculate`): Loom with and without it,
on the same loads, taking turns, in one run.

Loads (streaming /v1/completions, greedy, ignore_eos, 128 new tokens, fresh prompts every run):
- quote: a summarisation-like prompt of ~150 words that asks for an answer quoting its article,
  so drafts looked up in the prompt are often right;
- random: bench_vs_llamacpp's ~150 random words (drafts are rarely right: the cost of trying).

Both servers run at once (loom-launcher with its defaults, and the same plus `--speculate N`),
measured one at a time, never both under load. Acceptance is read from each run's /metrics
delta (loom_spec_accepted_tokens_total / loom_spec_draft_tokens_total).

    .venv/bin/python bench/bench_speculate.py --speculate 4 --result-file spec.json

`--step-cost` instead times the shard alone (ModelRunner, embedded model, default dtype): a plain
decode step against a verify step of 1 + N tokens per sequence, alternating, at batch 1 and 8;
minimum and median of each (the minimum is the least disturbed by other load on the machine).

    .venv/bin/python bench/bench_speculate.py --step-cost --speculate 4
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import sys
from pathlib import Path

from common import launcher, machine, metrics

from loom_bench import datasets
from loom_bench.backends import BACKENDS, BackendOptions
from loom_bench.runner import Load, run_load
from loom_bench.stats import Summary, summarize

SENTENCES = [
    "The harbour council met on {day} to discuss the {thing} by the old pier.",
    "Members agreed that the {thing} should be repaired before the winter storms arrive.",
    "The fish market will open on {day}s from next month, the mayor said.",
    "Local fishermen asked for a new {thing} and more lights along the north wall.",
    "The lighthouse will be painted white and red, as it was a hundred years ago.",
    "A report on the {thing} showed that the costs had doubled since last year.",
    "Tourists spent more money in the town this summer than in any year before.",
    "The school will take its pupils to visit the {thing} on {day}.",
    "Repairs to the {thing} are expected to take about six weeks.",
    "The council will meet again on {day} to vote on the final plan.",
]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"]
THINGS = ["sea wall", "boat ramp", "crane", "ferry dock", "fuel station", "net store", "slipway"]


def quote_requests(n: int, output_len: int, seed: int) -> list[datasets.BenchRequest]:
    """Summarisation-like prompts (~150 words each) whose answer quotes the article."""
    rng = random.Random(seed)
    requests = []
    for _ in range(n):
        sentences = rng.sample(SENTENCES, len(SENTENCES))
        article = " ".join(s.format(day=rng.choice(DAYS), thing=rng.choice(THINGS)) for s in sentences)
        prompt = (f"Article: {article}\n\nSummarise the article in a few sentences, quoting its key "
                  f"sentences word for word.\n\nSummary: {sentences[0].split(' ')[0]}")
        requests.append(datasets.BenchRequest(prompt, output_len))
    return requests


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--speculate", type=int, default=4, help="drafted tokens per step for the speculative server")
    p.add_argument("--concurrency", default="1,8", help="comma list of concurrencies")
    p.add_argument("--loads", default="quote,random", help="comma list of loads: quote, random")
    p.add_argument("--rounds", type=int, default=2, help="runs per load, concurrency and server")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--requests-per-stream", type=int, default=2, help="requests per run = this x concurrency")
    p.add_argument("--min-requests", type=int, default=4)
    p.add_argument("--loom-args", default="", help="flags for both servers")
    p.add_argument("--result-file", type=Path)
    p.add_argument("--step-cost", action="store_true", help="time decode vs verify steps in the shard only")
    p.add_argument("--steps", type=int, default=30, help="--step-cost: steps of each kind per batch size")
    return p


def step_cost(k: int, steps: int) -> None:
    """Decode step vs verify step (1 + k tokens a sequence; random drafts, so the sequences move
    one token a step like the decodes) in the shard alone, alternating."""
    import statistics
    import time

    from loom_proto.config import ShardConfig
    from loom_proto.step import NewRequest, RunningRequest, SamplingParams, StepPlan
    from loom_shard.runtime.runner import ModelRunner

    prompt_len = 150
    for batch in (1, 8):
        tokens_per_seq = prompt_len + 2 * steps * (k + 1) + 16
        runner = ModelRunner(ShardConfig(model_id="", uds_path="", device="cpu",
                                         max_batch_total_tokens=batch * (tokens_per_seq + 16)))
        warm = runner.warmup(prompt_len * batch, None)
        blocks = -(-tokens_per_seq // warm.block_size)
        rng = random.Random(batch)
        vocab = runner.info().vocab_size
        runner.step(StepPlan(new_requests=[
            NewRequest(i, [rng.randrange(vocab) for _ in range(prompt_len)], prompt_len, 0, prompt_len,
                       list(range(i * blocks, (i + 1) * blocks)), SamplingParams(seed=i)) for i in range(batch)]))
        times: dict[str, list[float]] = {"decode": [], "verify": []}
        for _ in range(steps):
            for kind in times:
                drafts = (lambda: [rng.randrange(vocab) for _ in range(k)]) if kind == "verify" else list
                num_compute = 1 + (k if kind == "verify" else 0)
                plan = StepPlan(running_requests=[
                    RunningRequest(i, num_compute, _more_blocks(runner, i, num_compute, blocks), draft_token_ids=drafts())
                    for i in range(batch)])
                start = time.perf_counter()
                runner.step(plan)
                times[kind].append((time.perf_counter() - start) * 1e3)
        d, v = times["decode"], times["verify"]
        print(f"batch {batch}: decode step min {min(d):.1f} / median {statistics.median(d):.1f} ms; "
              f"verify step (1 + {k} tokens a sequence) min {min(v):.1f} / median {statistics.median(v):.1f} ms; "
              f"verify / decode {min(v) / min(d):.2f}x (min), {statistics.median(v) / statistics.median(d):.2f}x "
              f"(median); load average {os.getloadavg()[0]:.2f}", flush=True)


def requests_for(load: str, count: int, output_len: int, seed: int) -> list[datasets.BenchRequest]:
    if load == "quote":
        return quote_requests(count, output_len, seed)
    return datasets.random_requests(count, 150, output_len, 0.0, seed)


async def measure(url: str, requests: list[datasets.BenchRequest], concurrency: int, label: str
                  ) -> tuple[Summary, float | None]:
    """A run's summary and its acceptance rate (None without drafts)."""
    before = metrics(url)
    opts = BackendOptions(model=None, ignore_eos=True, temperature=0.0)
    run = await run_load(requests, [url], BACKENDS["openai"], opts, Load(concurrency, float("inf")),
                         seed=0, progress=False, timeout_s=900.0)
    after = metrics(url)
    drafted = after.get("loom_spec_draft_tokens_total", 0.0) - before.get("loom_spec_draft_tokens_total", 0.0)
    accepted = after.get("loom_spec_accepted_tokens_total", 0.0) - before.get("loom_spec_accepted_tokens_total", 0.0)
    summary = summarize(label, run.by_server[url], run.duration_s, None)
    if summary.failed:
        print(f"  {label}: {summary.failed} failed: {summary.errors}", file=sys.stderr)
    return summary, (accepted / drafted if drafted else None)


async def compare(args: argparse.Namespace, urls: dict[str, str]) -> list[dict]:
    rows = []
    for name, url in urls.items():  # one-time costs first
        await measure(url, requests_for("random", 2, 16, 10**6), 1, f"{name} warmup")
    seed = 0
    for load in args.loads.split(","):
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            for round_ in range(args.rounds):
                seed += 1
                order = list(urls) if round_ % 2 == 0 else list(reversed(urls))
                count = max(args.min_requests, args.requests_per_stream * concurrency)
                for name in order:  # both servers get the same fresh prompts
                    load_before = os.getloadavg()[0]
                    summary, acceptance = await measure(
                        urls[name], requests_for(load, count, args.output_len, seed), concurrency, name)
                    row = {"load": load, "concurrency": concurrency, "round": round_, "server": name,
                           "output_tok_s": summary.output_throughput, "itl_p50_ms": summary.itl_ms.get("p50"),
                           "ttft_p50_ms": summary.ttft_ms.get("p50"), "acceptance": acceptance,
                           "load_avg_1m_before": load_before, "failed": summary.failed}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


def table(rows: list[dict], spec_name: str) -> str:
    lines = ["| load | concurrency | off tok/s | on tok/s | on / off | acceptance | ITL p50 off / on (ms) |",
             "|---|---|---|---|---|---|---|"]
    keys = sorted({(r["load"], r["concurrency"]) for r in rows}, key=lambda k: (k[0] != "quote", k[1]))
    for load, concurrency in keys:
        runs = [r for r in rows if (r["load"], r["concurrency"]) == (load, concurrency)]
        off = [r for r in runs if r["server"] == "off"]
        on = [r for r in runs if r["server"] == spec_name]
        off_tps = sum(r["output_tok_s"] for r in off) / len(off)
        on_tps = sum(r["output_tok_s"] for r in on) / len(on)
        accepted = [r["acceptance"] for r in on if r["acceptance"] is not None]
        lines.append(
            f"| {load} | {concurrency} | {_span([r['output_tok_s'] for r in off])} | "
            f"{_span([r['output_tok_s'] for r in on])} | {on_tps / off_tps:.2f}x | "
            f"{_span([100 * a for a in accepted], '%')} | "
            f"{_span([r['itl_p50_ms'] or 0 for r in off])} / {_span([r['itl_p50_ms'] or 0 for r in on])} |")
    return "\n".join(lines)


def _span(values: list[float], unit: str = "") -> str:
    if not values:
        return "-"
    low, high = min(values), max(values)
    return f"{low:.1f}{unit}" if abs(high - low) < 0.05 else f"{low:.1f}-{high:.1f}{unit}"


def _more_blocks(runner, request_id: int, num_compute: int, blocks: int) -> list[int]:  # noqa: ANN001
    """Blocks of the request's own range it lacks for this step (a verify step gives back the
    blocks only rejected drafts reached)."""
    state = runner.requests[request_id]
    needed = -(-(state.num_computed + num_compute) // runner.block_size) - len(state.block_table)
    pool = range(request_id * blocks, (request_id + 1) * blocks)
    return [b for b in pool if b not in state.block_table][:max(0, needed)]


def main() -> int:
    args = build_parser().parse_args()
    if args.step_cost:
        step_cost(args.speculate, args.steps)
        return 0
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    spec_name = f"speculate {args.speculate}"
    base = args.loom_args.split()
    with launcher(*base) as off_url, launcher(*base, "--speculate", str(args.speculate)) as on_url:
        rows = asyncio.run(compare(args, {"off": off_url, spec_name: on_url}))
    result = table(rows, spec_name)
    print(f"\n{started}; {machine()}; load average after {os.getloadavg()}\n\n{result}")
    if args.result_file:
        args.result_file.write_text(json.dumps({"date": started, "machine": machine(), "config": vars(args) | {
            "result_file": str(args.result_file)}, "runs": rows, "table": result}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
