"""KV snapshots: restore + first token against a cold prefill, for a 2,000-token prefix.

    python bench/bench_snapshot.py            # 5 repetitions, default dtype (bfloat16)
    python bench/bench_snapshot.py --reps 3 --dtype float32

A first loom-launcher saves one snapshot per repetition (a new random 2,000-token prefix
each). A second one, started fresh on the same --snapshot-dir (empty cache, as after a
restart), then times per repetition: cold = a request (prompt = another unseen random
2,000-token prefix + a 16-token suffix, max_tokens 1) from send to its token; warm =
POST /snapshots/{name}?action=restore, then the same kind of request on the restored prefix.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import tempfile
import time

import httpx
from common import launcher, machine

VOCAB_LOW, VOCAB_HIGH = 300, 40_000  # ordinary token ids of the embedded model's vocabulary
PREFIX_TOKENS, SUFFIX_TOKENS = 2000, 16


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


def first_token_s(client: httpx.Client, prompt_ids: list[int]) -> tuple[float, int]:
    """Seconds until the request's one token came back, and its cached prompt tokens."""
    start = time.perf_counter()
    response = client.post("/v1/completions", json={"prompt": prompt_ids, "max_tokens": 1, "temperature": 0})
    elapsed = time.perf_counter() - start
    response.raise_for_status()
    return elapsed, response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dtype", default=None, help="default: the server's (bfloat16 on CPU)")
    args = parser.parse_args()
    rng = random.Random(6)
    prefixes = [random_ids(rng, PREFIX_TOKENS) for _ in range(args.reps)]
    snapshot_dir = tempfile.mkdtemp(prefix="loom-bench-snapshots-")
    flags = ["--snapshot-dir", snapshot_dir, "--max-input-tokens", "2100", "--max-total-tokens", "2200",
             "--max-batch-prefill-tokens", "2048", "--max-batch-total-tokens", "16384"]
    if args.dtype:
        flags += ["--dtype", args.dtype]

    try:
        cold, warm, restore_ms, snapshot_bytes = run(flags, prefixes, rng)
    finally:
        shutil.rmtree(snapshot_dir, ignore_errors=True)
    report(args, cold, warm, restore_ms, snapshot_bytes)


def run(flags: list[str], prefixes: list[list[int]],
        rng: random.Random) -> tuple[list[float], list[float], list[float], int]:
    """Save on one server, then restore and time on a fresh one."""
    with launcher(*flags) as url, httpx.Client(base_url=url, timeout=600) as client:
        for i, prefix in enumerate(prefixes):
            client.post(f"/snapshots/bench-{i}?action=save", json={"token_ids": prefix}).raise_for_status()
    cold: list[float] = []
    warm: list[float] = []
    restore_ms: list[float] = []
    snapshot_bytes = 0
    with launcher(*flags) as url, httpx.Client(base_url=url, timeout=600) as client:
        first_token_s(client, random_ids(rng, 64))  # the first request pays one-off costs
        for i, prefix in enumerate(prefixes):
            elapsed, cached = first_token_s(client, random_ids(rng, PREFIX_TOKENS + SUFFIX_TOKENS))
            assert cached == 0
            cold.append(elapsed)
            start = time.perf_counter()
            answer = client.post(f"/snapshots/bench-{i}?action=restore")
            answer.raise_for_status()
            elapsed, cached = first_token_s(client, prefix + random_ids(rng, SUFFIX_TOKENS))
            warm.append(time.perf_counter() - start)
            assert cached == PREFIX_TOKENS // 16 * 16, cached
            restore_ms.append(answer.json()["ms"])
            snapshot_bytes = answer.json()["bytes"]
    return cold, warm, restore_ms, snapshot_bytes


def report(args: argparse.Namespace, cold: list[float], warm: list[float], restore_ms: list[float],
           snapshot_bytes: int) -> None:
    cold_med, warm_med = statistics.median(cold), statistics.median(warm)
    print(f"machine: {machine()}")
    print(f"prefix {PREFIX_TOKENS} tokens + {SUFFIX_TOKENS}, snapshot {snapshot_bytes / 2**20:.1f} MiB, "
          f"{args.reps} repetitions, dtype {args.dtype or 'default'}")
    print(f"cold prefill, first token:   median {cold_med * 1e3:7.0f} ms  (min {min(cold) * 1e3:.0f}, max {max(cold) * 1e3:.0f})")
    print(f"restore + first token:       median {warm_med * 1e3:7.0f} ms  (min {min(warm) * 1e3:.0f}, max {max(warm) * 1e3:.0f})")
    print(f"  of which restore (server): median {statistics.median(restore_ms):7.0f} ms")
    print(f"speed-up: {cold_med / warm_med:.1f}x")


if __name__ == "__main__":
    main()
