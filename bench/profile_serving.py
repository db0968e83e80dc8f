"""Where one stream's time per token goes: CPU time of the router, the shard and the client per
token, optionally with a py-spy profile of each process, for variants taking turns.

    python bench/profile_serving.py --rounds 3                          # Loom's defaults
    python bench/profile_serving.py --variant base --variant spin,GOMP_SPINCOUNT=0 --rounds 3
    python bench/profile_serving.py --py-spy /tmp/prof --rounds 1       # + top functions per process

A variant is "NAME[,ENV=VALUE...][ launcher flags]"; its environment goes to
the launcher and so to its children (PYTHONPATH=<another checkout's component folders> measures
other code). Each round starts every variant's launcher once, in turn, and streams `--requests`
greedy completions (ignore_eos, `--new-tokens` each, a ~150-token prompt) one at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import signal
import statistics
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from bench_serving import BASE_PROMPT
from common import launcher, machine, stream_completion

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PY_SPY = str(Path(sys.executable).parent / "py-spy")  # the dev extra's, next to this Python


@dataclass(slots=True)
class Variant:
    name: str
    env: dict[str, str]
    flags: list[str]
    itl_ms: list[float] = field(default_factory=list)  # median inter-token latency, per round
    cpu_ms_per_token: list[dict[str, float]] = field(default_factory=list)

    @classmethod
    def parse(cls, text: str) -> Variant:
        head, _, flags = text.strip().partition(" ")
        name, *env_items = head.split(",")
        return cls(name, dict(item.split("=", 1) for item in env_items), flags.split())


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def process_pids(launcher_pid: int) -> dict[str, int]:
    """The router's and each shard's pid, from the launcher's children's command lines."""
    found = {}
    for pid in children(launcher_pid):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        if "loom_router.main" in cmdline:
            found["router"] = pid
        elif "loom_shard.server" in cmdline:
            found[f"shard{len([k for k in found if k.startswith('shard')])}"] = pid
    return found


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


def client_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def stream_requests(url: str, num: int, new_tokens: int, tag: str) -> tuple[list[float], int]:
    params = {"max_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    itl, tokens = [], 0
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for i in range(num):
            timing = await stream_completion(client, {"prompt": f"{tag} request {i}. {BASE_PROMPT}", **params})
            itl.extend(timing.inter_token_s)
            tokens += timing.num_tokens
    return itl, tokens


def start_py_spy(pids: dict[str, int], folder: Path, tag: str) -> list[subprocess.Popen]:
    folder.mkdir(parents=True, exist_ok=True)
    return [subprocess.Popen([PY_SPY, "record", "--pid", str(pid), "--rate", "200", "--format", "raw",
                              "--output", str(folder / f"{tag}-{name}.txt"), "--nonblocking"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for name, pid in pids.items()]


def stop_py_spy(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.send_signal(signal.SIGINT)
    for proc in procs:
        proc.wait(60)


def top_functions(raw: Path, limit: int) -> str:
    """Self and inclusive sample shares of the busiest functions in a py-spy raw profile."""
    self_counts: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        count = int(count_text)
        frames = stack.split(";")[1:]  # the first is the thread
        total += count
        if frames:
            self_counts[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    rows = [f"  {raw.name}: {total} samples"]
    rows += [f"    self {n / total:6.1%}  {frame}" for frame, n in self_counts.most_common(limit)]
    rows += [f"    incl {n / total:6.1%}  {frame}" for frame, n in inclusive.most_common(limit)]
    return "\n".join(rows)


def run_variant(variant: Variant, args: argparse.Namespace, round_index: int) -> None:
    saved = dict(os.environ)
    os.environ.update(variant.env)
    try:
        with launcher(*variant.flags) as url:
            os.environ.clear()
            os.environ.update(saved)
            pids = process_pids(_launcher_pid_by_port(url))
            asyncio.run(stream_requests(url, 1, 16, "warm"))
            before = {name: cpu_s(pid) for name, pid in pids.items()} | {"client": client_cpu_s()}
            spies = start_py_spy(pids, args.py_spy, f"{variant.name}-r{round_index}") if args.py_spy else []
            itl, tokens = asyncio.run(stream_requests(url, args.requests, args.new_tokens,
                                                      f"{variant.name} round {round_index}"))
            after = {name: cpu_s(pid) for name, pid in pids.items()} | {"client": client_cpu_s()}
            stop_py_spy(spies)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    variant.itl_ms.append(statistics.median(itl) * 1000)
    variant.cpu_ms_per_token.append({k: (after[k] - before[k]) * 1000 / tokens for k in before})
    cpu = ", ".join(f"{k} {v:.2f}" for k, v in variant.cpu_ms_per_token[-1].items())
    print(f"round {round_index} {variant.name}: ITL p50 {variant.itl_ms[-1]:.2f} ms; CPU ms/token: {cpu}; "
          f"load {os.getloadavg()[0]:.1f}", flush=True)


def _launcher_pid_by_port(url: str) -> int:
    """The launcher started by bench.common.launcher: the newest loom_launcher.cli with this port."""
    port = url.rsplit(":", 1)[1]
    pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]
    for pid in sorted(pids, reverse=True):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"loom_launcher.cli" in cmdline and port.encode() in cmdline:
            return pid
    raise RuntimeError(f"no launcher process serving port {port}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", action="append", type=Variant.parse, default=[],
                        help="'NAME[,ENV=V...][ flags]'; default: one variant, Loom's defaults")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=3, help="sequential requests per round")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--py-spy", type=Path, help="folder for py-spy raw profiles (one per process and round)")
    parser.add_argument("--top", type=int, default=25, help="functions listed per profile")
    args = parser.parse_args()
    variants = args.variant or [Variant("default", {}, [])]
    print(f"machine: {machine()}; load before: {os.getloadavg()}")
    for r in range(args.rounds):
        for variant in variants:
            run_variant(variant, args, r)
    print("| variant | ITL p50 per round (ms) | median | CPU ms/token (median of rounds) |")
    print("|---|---|---|---|")
    for v in variants:
        keys = v.cpu_ms_per_token[0].keys()
        cpu = ", ".join(f"{k} {statistics.median(c[k] for c in v.cpu_ms_per_token):.2f}" for k in keys)
        print(f"| {v.name} | {' / '.join(f'{x:.2f}' for x in v.itl_ms)} | {statistics.median(v.itl_ms):.2f} | {cpu} |")
    if args.py_spy:
        for raw in sorted(args.py_spy.glob("*.txt")):
            print(top_functions(raw, args.top))


if __name__ == "__main__":
    main()
