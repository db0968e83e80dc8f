"""Loom against llama.cpp's `llama-server` on the same machine, the same model and the same load:
streaming /v1/completions, greedy, ignore_eos, ~150-word prompts, 128 new tokens.

Both servers are started (Loom through loom-launcher with its defaults; llama-server with the
embedded Q4_1 GGUF, `-t 2 -np 32 -c 16384`) and measured one at a time, taking turns, never
both under load at once: for each round and concurrency, each server gets the same fresh
prompts (distinct from every other run's, so no prompt cache serves them). Prints the issue's
table and whether its targets are met.

    .venv/bin/python bench/bench_vs_llamacpp.py ../shared/peers/llama-server --result-file vs.json

`--model PATH` has both load another GGUF (e.g. a Q4_K_M file) instead of the embedded one.

`--as-avx2` measures both as an AVX2-only CPU (an AVX2 EPYC) runs them, on a CPU with more:
Loom reading the CPU as AVX2-only, as oneDNN and ATen do (`loom_shard.cpu.as_cpu_env`), llama-server
from a temporary copy of its folder that holds only its `haswell` CPU variant (AVX2 + FMA + F16C).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import httpx
from common import REPO, ServerURL, free_port, launcher, machine, serving, tree_cpu_s

from loom_bench import datasets
from loom_bench.backends import BACKENDS, BackendOptions
from loom_bench.runner import Load, run_load
from loom_bench.stats import summarize
from loom_bench.versus import LOOM, PEER, Measure, Pair, render_table, render_verdicts, schedule, verdicts
from loom_proto.embedded import embedded_model_path
from loom_shard.cpu import as_cpu_env

OUTPUT_LEN = 128
WARMUP_SEED = 10**6  # a seed no measured run uses


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("llama_server", type=Path, help="path of a llama-server binary (or wrapper script)")
    p.add_argument("--concurrency", default="1,8,32", help="comma list of concurrencies")
    p.add_argument("--rounds", type=int, default=2, help="runs per concurrency and server")
    p.add_argument("--prompt-words", type=int, default=150)
    p.add_argument("--output-len", type=int, default=OUTPUT_LEN)
    p.add_argument("--requests-per-stream", type=int, default=2, help="requests per run = this x concurrency")
    p.add_argument("--min-requests", type=int, default=4, help="at least this many requests per run")
    p.add_argument("--peer-args", default="-t 2 -np 32 -c 16384", help="llama-server flags besides model/port")
    p.add_argument("--loom-args", default="", help="loom-launcher flags (default: none, its defaults)")
    p.add_argument("--result-file", type=Path, help="write every measure as JSON")
    p.add_argument("--model", type=Path, help="a GGUF both servers load (default: the embedded Q4_1 one)")
    p.add_argument("--as-avx2", action="store_true",
                   help="both servers as on an AVX2-only CPU (Loom's avx2 build, llama.cpp's haswell variant)")
    return p


@contextlib.contextmanager
def llama_server(binary: Path, model: Path, args: list[str], timeout_s: float = 300.0) -> Iterator[ServerURL]:
    """Start llama-server with the GGUF on a free port; yield its base URL once healthy."""
    port = free_port()
    cmd = [str(binary), "-m", str(model), *args, "--host", "127.0.0.1", "--port", str(port)]
    with serving(cmd, port, "llama-server", timeout_s) as url:
        yield url


@contextlib.contextmanager
def only_variant(binary: Path, variant: str) -> Iterator[Path]:
    """A temporary copy of llama-server's folder (found from `binary`, or the wrapper script
    beside it) holding one CPU variant library, `libggml-cpu-<variant>.so`, so that the server
    cannot load a better one; yields a script that runs the copy."""
    found = next(binary.resolve().parent.rglob(f"libggml-cpu-{variant}.so"), None)
    if found is None:
        sys.exit(f"bench_vs_llamacpp: no libggml-cpu-{variant}.so under {binary.resolve().parent}")
    with tempfile.TemporaryDirectory(prefix="llama-server-") as tmp:
        folder = Path(tmp)
        for path in found.parent.iterdir():
            if path.is_file() and (path == found or not path.name.startswith("libggml-cpu-")):
                shutil.copy2(path, folder)
        script = folder / "llama-server.sh"
        script.write_text(f'#!/bin/sh\nLD_LIBRARY_PATH="{folder}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}" '
                          f'exec "{folder}/llama-server" "$@"\n')
        script.chmod(0o755)
        yield script


def peer_version(binary: Path) -> str:
    """llama-server's `--version` line; exits saying why when the binary cannot run."""
    try:
        done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    except OSError as error:
        sys.exit(f"bench_vs_llamacpp: cannot run {binary}: {error}")
    output = (done.stdout + done.stderr).strip()
    if done.returncode != 0:
        sys.exit(f"bench_vs_llamacpp: `{binary} --version` failed ({done.returncode}): {output[-500:]}")
    return " ".join(line for line in output.splitlines() if "version" in line).strip()


def loom_version(loom_url: str) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    info = httpx.get(f"{loom_url}/info", timeout=10).json()
    return f"commit {commit.stdout.strip()}, " + ", ".join(
        f"{k} {info[k]}" for k in ("version", "model_dtype", "model_device_type", "cpu_kernels") if k in info)


def run_requests(args: argparse.Namespace, concurrency: int, seed: int) -> list[datasets.BenchRequest]:
    count = max(args.min_requests, args.requests_per_stream * concurrency)
    return datasets.random_requests(count, args.prompt_words, args.output_len, 0.0, seed)


async def measure(url: str, requests: list[datasets.BenchRequest], concurrency: int, label: str):
    opts = BackendOptions(model=None, ignore_eos=True, temperature=0.0)
    run = await run_load(requests, [url], BACKENDS["openai"], opts, Load(concurrency, float("inf")),
                         seed=0, progress=True, timeout_s=600.0)
    summary = summarize(label, run.by_server[url], run.duration_s, None)
    if summary.failed:
        print(f"  {label}: {summary.failed} failed: {summary.errors}", file=sys.stderr)
    return summary


async def compare(args: argparse.Namespace, urls: dict[str, ServerURL]) -> tuple[list[Pair], list[dict]]:
    concurrencies = [int(c) for c in args.concurrency.split(",") if c.strip()]
    for name, url in urls.items():  # first requests pay one-time costs (allocations, caches)
        await measure(url, run_requests(args, 1, WARMUP_SEED)[:2], 1, f"{name} warmup")
    pairs, log = [], []
    for spec in schedule(concurrencies, args.rounds):
        measures = {}
        for name in spec.order:
            load_before, cpu_before = os.getloadavg()[0], tree_cpu_s(urls[name].pid)
            summary = await measure(urls[name], run_requests(args, spec.concurrency, spec.seed), spec.concurrency, name)
            cpu = tree_cpu_s(urls[name].pid) - cpu_before
            measures[name] = m = Measure.of(summary, spec.concurrency, spec.round, cpu)
            log.append({"server": name, "concurrency": spec.concurrency, "round": spec.round,
                        "load_avg_1m_before": load_before, "summary": summary.to_json()})
            print(f"round {spec.round + 1}/{args.rounds} concurrency {spec.concurrency} {name}: "
                  f"{m.output_tok_s:.1f} tok/s, TTFT p50 {m.ttft_p50_ms or 0:.0f} ms, "
                  f"ITL p50 {m.itl_p50_ms or 0:.1f} ms, CPU {m.cpu_ms_per_token or 0:.2f} ms/token, "
                  f"load avg before {load_before:.2f}", flush=True)
        pairs.append(Pair(measures[LOOM], measures[PEER]))
    return pairs, log


def main() -> int:
    args = build_parser().parse_args()
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    loom_env = as_cpu_env("avx2") if args.as_avx2 else {}
    with contextlib.ExitStack() as stack:
        peer = stack.enter_context(only_variant(args.llama_server, "haswell")) if args.as_avx2 else args.llama_server
        server_versions = {PEER: peer_version(peer)}
        model = args.model or embedded_model_path()
        peer_url = stack.enter_context(llama_server(peer, model, args.peer_args.split()))
        loom_flags = [*args.loom_args.split(), *(["--model-id", str(args.model)] if args.model else [])]
        loom_url = stack.enter_context(launcher(*loom_flags, env=loom_env))
        urls = {LOOM: loom_url, PEER: peer_url}
        server_versions[LOOM] = loom_version(loom_url)
        pairs, log = asyncio.run(compare(args, urls))
    table, checks = render_table(pairs), verdicts(pairs)
    as_avx2 = " (as an AVX2-only CPU: Loom's avx2 build, llama.cpp's haswell variant)" if args.as_avx2 else ""
    print(f"\n{started}; {machine()}{as_avx2}; model {model.name}; load average after {os.getloadavg()}")
    print("\n".join(f"{name}: {version}" for name, version in server_versions.items()))
    print(f"\n{table}\n\n{render_verdicts(checks)}")
    if args.result_file:
        args.result_file.write_text(json.dumps({
            "date": started, "machine": machine(), "versions": server_versions, "config": vars(args) | {
                "llama_server": str(args.llama_server), "result_file": str(args.result_file), "model": str(model)},
            "pairs": [{"loom": asdict(p.loom), "peer": asdict(p.peer)} for p in pairs], "runs": log,
            "verdicts": [asdict(v) for v in checks], "table": table}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
