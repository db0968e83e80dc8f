"""The serving layer's ceiling: the real router, started by the real launcher, in front of a shard
that computes nothing (bench/zero_cost_shard.py), so that what is measured is the router's own cost.

    python bench/bench_ceiling.py                                   # every endpoint, 1 to 512 streams
    python bench/bench_ceiling.py --streams 1 256 --endpoint chat --launcher-flag=--api-workers=2
    python bench/bench_ceiling.py --real-shard --launcher-flag=--device=cuda   # the served model on a GPU
    python bench/bench_ceiling.py --simulated-gpu --variant ahead --variant "serial --launch-ahead=false"

Each (endpoint, streams) run opens `streams` concurrent streams, each sending `--requests` requests
one after the other (greedy, ignore_eos, `--new-tokens` each), from `--client-procs` processes so
that one client's event loop is not what limits. It reports output tokens/s, the router's CPU time
per streamed token (utime + stime from /proc of every process the launcher started except the
shard: the router, or its engine core and frontends), TTFT and the gap between a stream's events
(p50, p99), and how many tokens an event carried on average (above 1: the server coalesced tokens
of a stream that fell behind). CPU times of the shard and of the clients are shown too. From the
server's own /metrics over the run: its decode and prefill steps, how long the shard spent in
them (mean ms a step; the zero-cost shard's is its simulated device time), and what share of the
run's wall time the shard was in a step and how much it waited between steps while the router had
work (near 0%: the router keeps it fed), and the share of steps the engine core planned while the
one before ran (with --overlap-steps).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from itertools import accumulate
from pathlib import Path
from statistics import median

import aiohttp
from common import cpu_s, descendants, free_port, machine, percentile, serving, sustained_rate
from prometheus_client.parser import text_string_to_metric_families

BENCH = Path(__file__).resolve().parent
SHARD_MODULE = "zero_cost_shard"
# The launcher, with the zero-cost shard in place of loom_shard.server; every other process
# (router, or engine core and frontends) is started exactly as `loom-launcher` starts it.
LAUNCHER = ("import sys, loom_launcher.cli as cli; cli.SHARD_MODULE = {module!r}; "
            "sys.exit(cli.main(sys.argv[1:]))")
PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
RUN_TOKENS = 1 << 17  # tokens a run streams by default, above one stream
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "generate_stream": "/generate_stream"}


@dataclass(slots=True)
class RequestStats:
    ok: bool
    tokens: int = 0
    events: int = 0
    ttft_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)
    started: float = 0.0  # time.time() at the request (comparable across the client processes)
    error: str = ""


def request_body(endpoint: str, new_tokens: int, index: int) -> dict:
    prompt = f"{index}. {PROMPT}"
    if endpoint == "generate_stream":
        # TGI has no ignore_eos: the zero-cost shard never samples EOS, so every request runs to its end
        return {"inputs": prompt, "parameters": {"max_new_tokens": new_tokens}}
    body = {"max_tokens": new_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        return {**body, "messages": [{"role": "user", "content": prompt}]}
    return {**body, "prompt": prompt}


async def one_request(session: aiohttp.ClientSession, url: str, endpoint: str, body: dict) -> RequestStats:
    """One stream, parsed as little as possible: JSON only for the usage and error events."""
    start = time.perf_counter()
    stats, last = RequestStats(ok=True, started=time.time()), None
    async with session.post(url + ENDPOINTS[endpoint], json=body) as response:
        if response.status != 200:
            return RequestStats(False, error=f"HTTP {response.status}: {(await response.text())[:200]}")
        async for line in response.content:
            if not line.startswith(b"data:"):
                continue
            if b'"error"' in line[:20]:
                return RequestStats(False, error=line.decode(errors="replace")[:200])
            if b"[DONE]" in line or b'"role"' in line:
                continue
            usage_at = line.find(b'"usage"')
            if usage_at >= 0 and not line[usage_at + 7:].lstrip(b": ").startswith(b"null"):
                event = json.loads(line[5:])
                stats.tokens = event["usage"]["completion_tokens"]
                if not event["choices"]:
                    continue
            now = time.perf_counter()
            if last is None:
                stats.ttft_s = now - start
            else:
                stats.gaps_s.append(now - last)
            last = now
            stats.events += 1
    if endpoint == "generate_stream":
        stats.tokens = stats.events  # TGI streams one token per event
    return stats


async def client_streams(url: str, endpoint: str, stream_ids: list[int], num_requests: int,
                         new_tokens: int) -> list[RequestStats]:
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(url, connector=connector, timeout=timeout) as session:
        async def stream(stream_id: int) -> list[RequestStats]:
            out = []
            for r in range(num_requests):
                body = request_body(endpoint, new_tokens, stream_id * num_requests + r)
                try:
                    out.append(await one_request(session, "", endpoint, body))
                except (aiohttp.ClientError, TimeoutError) as error:
                    out.append(RequestStats(False, error=repr(error)))
            return out

        results = await asyncio.gather(*(stream(i) for i in stream_ids))
    return [r for rs in results for r in rs]


def client_process(url: str, endpoint: str, stream_ids: list[int], num_requests: int, new_tokens: int,
                   start_at: float, queue: mp.Queue) -> None:
    import uvloop

    time.sleep(max(0.0, start_at - time.time()))
    before = os.times()
    results = uvloop.run(client_streams(url, endpoint, stream_ids, num_requests, new_tokens))
    after = os.times()
    cpu = (after.user - before.user) + (after.system - before.system)
    queue.put(([asdict(r) for r in results], cpu))


# ---- processes and their CPU time ------------------------------------------------------------


def process_label(pid: int) -> str:
    """`-m module` of a process's command line (the launcher's children are started that way)."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    if "-m" in argv:
        return argv[argv.index("-m") + 1]
    return SHARD_MODULE if any(SHARD_MODULE in a for a in argv) else Path(argv[0]).name


def cpu_by_label(launcher_pid: int) -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)
    for pid in descendants(launcher_pid):
        try:
            totals[process_label(pid)] += cpu_s(pid)
        except OSError:
            continue  # it exited meanwhile
    return dict(totals)


# ---- one run ----------------------------------------------------------------------------------


@dataclass(slots=True)
class RunResult:
    endpoint: str
    streams: int
    requests: int
    failed: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    sustained_tokens_per_s: float  # between the 10th and 90th percentile of the events' arrivals
    router_cpu_us_per_token: float
    cpu_us_per_token: dict[str, float]  # by process label, plus "client"
    tokens_per_event: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    errors: list[str]
    steps: dict[str, float]  # step_summary: the server's steps over the run


def step_totals(url: str) -> dict[str, float]:
    """The server's step counters: `count` and `sum` of the shard's step times (TGI's batch forward
    duration: the runner's forward, sampling and outputs) by method, and of the shard's waits
    between steps, e.g. {"decode.count": 310.0, "idle.sum": 0.02}; the engine's steps and those
    it planned ahead ("loom_steps", "loom_steps_planned_ahead"; the second absent before it existed)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10.0) as response:
        text = response.read().decode()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in ("loom_steps", "loom_steps_planned_ahead"):
            totals[family.name] = family.samples[0].value
        if family.name not in ("tgi_batch_forward_duration", "loom_shard_idle_seconds"):
            continue
        for sample in family.samples:
            kind = sample.name.rpartition("_")[2]
            name = "idle" if family.name == "loom_shard_idle_seconds" else sample.labels["method"]
            if kind in ("count", "sum"):
                totals[f"{name}.{kind}"] = sample.value
    return totals


def step_summary(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict[str, float]:
    """A run's decode and prefill steps, the shard's mean step, the shares of the wall time it
    spent in steps and waiting between them, and the share of steps planned ahead (NaN: a server
    that does not count them)."""
    delta = {key: value - before.get(key, 0.0) for key, value in after.items()}
    steps = delta.get("decode.count", 0.0) + delta.get("prefill.count", 0.0)
    busy = delta.get("decode.sum", 0.0) + delta.get("prefill.sum", 0.0)
    ahead = delta.get("loom_steps_planned_ahead", math.nan) / max(delta.get("loom_steps", 0.0), 1.0)
    return {"decode_steps": delta.get("decode.count", 0.0), "prefill_steps": delta.get("prefill.count", 0.0),
            "shard_step_ms": busy * 1e3 / max(steps, 1.0), "shard_busy": busy / wall_s,
            "shard_idle": delta.get("idle.sum", 0.0) / wall_s, "planned_ahead": ahead}


PROFILED = ("loom_shard.server", "loom_router.main", "loom_router.frontend.main")  # one of each


def start_profiles(launcher_pid: int, out: Path, tag: str, seconds: int) -> list[subprocess.Popen]:
    """py-spy samples of the shard, the engine core and a frontend for `seconds` (collapsed stacks,
    out/TAG-LABEL.txt), without pausing them (--nonblocking)."""
    spy = shutil.which("py-spy")
    if spy is None:
        raise SystemExit("--py-spy-out needs py-spy on PATH (pip install py-spy)")
    out.mkdir(parents=True, exist_ok=True)
    pids = {}
    for pid in descendants(launcher_pid):
        with contextlib.suppress(OSError):
            pids.setdefault(process_label(pid), pid)
    return [subprocess.Popen([spy, "record", "--pid", str(pids[label]), "--duration", str(seconds), "--rate", "250",
                              "--nonblocking", "--format", "raw", "--output", str(out / f"{tag}-{label}.txt")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for label in PROFILED if label in pids]


def run(url: str, launcher_pid: int, endpoint: str, streams: int, num_requests: int, new_tokens: int,
        client_procs: int, profile: tuple[Path, int] | None = None) -> RunResult:
    procs = max(1, min(client_procs, streams))
    ctx = mp.get_context("fork")
    queue: mp.Queue = ctx.Queue()
    start_at = time.time() + 0.5
    workers = [ctx.Process(target=client_process, args=(url, endpoint, list(range(p, streams, procs)),
                                                          num_requests, new_tokens, start_at, queue))
               for p in range(procs)]
    for worker in workers:
        worker.start()
    time.sleep(max(0.0, start_at - time.time()))
    before, steps_before, wall = cpu_by_label(launcher_pid), step_totals(url), time.perf_counter()
    spies = start_profiles(launcher_pid, profile[0], f"{endpoint}-{streams}", profile[1]) if profile else []
    outputs = [queue.get() for _ in workers]
    wall = time.perf_counter() - wall
    after = cpu_by_label(launcher_pid)
    steps = step_summary(steps_before, step_totals(url), wall)
    for worker in [*workers, *spies]:
        worker.wait() if isinstance(worker, subprocess.Popen) else worker.join()
    stats = [RequestStats(**r) for rs, _ in outputs for r in rs]
    ok = [s for s in stats if s.ok]
    tokens = sum(s.tokens for s in ok)
    cpu = {label: after[label] - before.get(label, 0.0) for label in after}
    per_token = {label: seconds * 1e6 / max(tokens, 1) for label, seconds in cpu.items()}
    per_token["client"] = sum(c for _, c in outputs) * 1e6 / max(tokens, 1)
    router = sum(v for label, v in per_token.items() if label.startswith("loom_router"))
    gaps = [g for s in ok for g in s.gaps_s]
    ttfts = [s.ttft_s for s in ok]
    return RunResult(endpoint, streams, len(stats), len(stats) - len(ok), tokens, wall, tokens / wall,
                     sustained_rate([a for s in ok for a in event_arrivals(s)]), router,
                     per_token, tokens / max(1, sum(s.events for s in ok)),
                     percentile(ttfts, 0.5) * 1e3, percentile(ttfts, 0.99) * 1e3,
                     percentile(gaps, 0.5) * 1e3, percentile(gaps, 0.99) * 1e3,
                     sorted({s.error for s in stats if not s.ok})[:3], steps)


def event_arrivals(s: RequestStats) -> list[tuple[float, float]]:
    """(time, tokens) of each of a request's events, its tokens spread evenly over its events."""
    per_event = s.tokens / max(s.events, 1)
    times = list(accumulate(s.gaps_s, initial=s.started + s.ttft_s))
    return [(t, per_event) for t in times]


def warm_up(url: str, endpoint: str) -> None:
    async def go() -> None:
        async with aiohttp.ClientSession(url) as session:
            result = await one_request(session, "", endpoint, request_body(endpoint, 16, 0))
            if not result.ok:
                raise RuntimeError(f"warm-up failed on {endpoint}: {result.error}")

    asyncio.run(go())


def launcher_pid(port: int) -> int:
    for proc in sorted(Path("/proc").iterdir(), key=lambda p: -int(p.name) if p.name.isdigit() else 0):
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(b"loom_launcher.cli" in a for a in argv) and str(port).encode() in argv:
            return int(proc.name)
    raise RuntimeError(f"no launcher on port {port}")


def row(r: RunResult) -> str:
    others = ", ".join(f"{k.removeprefix('loom_router.')} {v:.1f}" for k, v in sorted(r.cpu_us_per_token.items()))
    failed = f" ({r.failed} failed)" if r.failed else ""
    return (f"| {r.endpoint} | {r.streams} | {r.tokens_per_s:,.0f}{failed} | {r.sustained_tokens_per_s:,.0f} | "
            f"**{r.router_cpu_us_per_token:.1f}** | "
            f"{r.ttft_p50_ms:.1f} / {r.ttft_p99_ms:.1f} | {r.itl_p50_ms:.2f} / {r.itl_p99_ms:.2f} | "
            f"{r.tokens_per_event:.2f} | {steps_cell(r.steps)} | {others} |")


def steps_cell(steps: dict[str, float]) -> str:
    ahead = steps.get("planned_ahead", math.nan)
    return (f"{steps['decode_steps']:.0f} / {steps['prefill_steps']:.0f}, {steps['shard_step_ms']:.2f} ms, "
            f"{steps['shard_busy']:.0%} / {steps['shard_idle']:.0%}" + ("" if math.isnan(ahead) else f", {ahead:.1%}"))


HEADER = ("| endpoint | streams | tokens/s | sustained tokens/s (p10-p90) | router CPU µs/token | TTFT p50 / p99 ms | "
          "event gap p50 / p99 ms | tokens/event | steps decode / prefill, shard's mean step, shard in steps / idle, "
          "steps planned ahead | "
          "CPU µs/token by process |\n|---|---|---|---|---|---|---|---|---|---|")


@dataclass(slots=True)
class Variant:
    """What one server runs: its environment (PYTHONPATH=<another checkout> measures other code)
    and launcher flags, as profile_serving's "NAME[,ENV=VALUE...][ flags]"."""

    name: str
    env: dict[str, str]
    flags: list[str]

    @classmethod
    def parse(cls, text: str) -> Variant:
        head, _, flags = text.strip().partition(" ")
        name, *env_items = head.split(",")
        return cls(name, dict(item.split("=", 1) for item in env_items), flags.split())


def requests_per_stream(streams: int, new_tokens: int) -> int:
    """Enough that a run streams about RUN_TOKENS tokens (at least 2 requests per stream): a
    short run is mostly its ramp up and its tail, where fewer streams share each step. One
    stream makes a token a step: 32 requests."""
    if streams == 1:
        return 32
    return max(2, round(RUN_TOKENS / (streams * new_tokens)))


def run_variant(variant: Variant, args: argparse.Namespace, endpoints: list[str]) -> list[RunResult]:
    port = free_port()
    flags = ["--port", str(port), "--hostname", "127.0.0.1", "--shard-uds-path", tempfile.mktemp(prefix="loom-ceil-"),
             "--max-concurrent-requests", str(max(args.streams) * 2), *args.launcher_flag, *variant.flags]
    module = "loom_shard.server" if args.real_shard else "simulated_gpu_shard" if args.simulated_gpu else SHARD_MODULE
    cmd = [sys.executable, "-c", LAUNCHER.format(module=module), *flags]
    saved = dict(os.environ)
    os.environ.update(variant.env)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(BENCH), os.environ.get("PYTHONPATH", "")])
    results = []
    try:
        with serving(cmd, port, "ceiling", 600.0 if args.real_shard else 120.0) as url:
            os.environ.clear()
            os.environ.update(saved)
            pid = launcher_pid(port)
            print(f"\n{variant.name}: {' '.join([*args.launcher_flag, *variant.flags]) or '(default flags)'}")
            print(HEADER, flush=True)
            profile = (args.py_spy_out, args.py_spy_seconds) if args.py_spy_out else None
            for endpoint in endpoints:
                warm_up(url, endpoint)
                for streams in args.streams:
                    num_requests = args.requests or requests_per_stream(streams, args.new_tokens)
                    result = run(url, pid, endpoint, streams, num_requests, args.new_tokens, args.client_procs,
                                 profile)
                    results.append(result)
                    print(row(result) + f"  (load {os.getloadavg()[0]:.1f})", flush=True)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 32, 128, 256, 512])
    parser.add_argument("--endpoint", choices=ENDPOINTS, action="append", help="default: all three")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--requests", type=int, help="requests per stream; default: about 128k tokens a run "
                        "(at least 2 per stream), 32 at one stream")
    parser.add_argument("--client-procs", type=int, default=4, help="load generator processes")
    parser.add_argument("--launcher-flag", action="append", default=[], help="extra launcher flag (repeatable)")
    parser.add_argument("--variant", action="append", type=Variant.parse, default=[],
                        help="'NAME[,ENV=V...][ flags]' (repeatable; variants take turns each round)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--real-shard", action="store_true", help="the real shard and model in place of the "
                        "zero-cost one (with --launcher-flag=--device=cuda: what HTTP leaves of a GPU's rate)")
    parser.add_argument("--simulated-gpu", action="store_true", help="bench/simulated_gpu_shard.py in place of the "
                        "zero-cost shard: the real shard server over a runner whose steps cost host work and a "
                        "simulated GPU's time (its SIM_* environment)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--py-spy-out", type=Path, help="a folder for py-spy samples of the shard, the engine "
                        "core and a frontend during each run (collapsed stacks)")
    parser.add_argument("--py-spy-seconds", type=int, default=3, help="how long each run is sampled")
    args = parser.parse_args()
    endpoints = args.endpoint or list(ENDPOINTS)
    variants = args.variant or [Variant("default", {}, [])]
    print(f"machine: {machine()}; load {os.getloadavg()[0]:.1f}")
    results: dict[str, list[RunResult]] = defaultdict(list)
    for _ in range(args.rounds):
        for variant in variants:
            results[variant.name] += run_variant(variant, args, endpoints)
    if args.json:
        args.json.write_text(json.dumps({name: [asdict(r) for r in rs] for name, rs in results.items()}, indent=1))
    if args.rounds > 1 or len(variants) > 1:
        print("\nmedians over rounds:\n| variant | endpoint | streams | tokens/s | sustained | "
              "router CPU µs/token | event gap p50 ms |\n|---|---|---|---|---|---|---|")
        for name, rs in results.items():
            by_run: dict[tuple[str, int], list[RunResult]] = defaultdict(list)
            for r in rs:
                by_run[(r.endpoint, r.streams)].append(r)
            for (endpoint, streams), runs in by_run.items():
                print(f"| {name} | {endpoint} | {streams} | {median(r.tokens_per_s for r in runs):,.0f} | "
                      f"{median(r.sustained_tokens_per_s for r in runs):,.0f} | "
                      f"{median(r.router_cpu_us_per_token for r in runs):.1f} | "
                      f"{median(r.itl_p50_ms for r in runs):.2f} |")


if __name__ == "__main__":
    main()
