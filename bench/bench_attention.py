"""Prefill attention on CPU: the blocked matmul attention vs SDPA (the path used before), interleaved.

Run: python bench/bench_attention.py [--threads 2] [--tile-rows 256 512 1024]
SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head dim 64), one layer.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from loom_shard.attention import blocked_causal_attention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64
SHAPES = [(512, 0), (2000, 0), (512, 1500), (16, 2000)]  # (chunk_len, num_cached)


def sdpa_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, num_cached: int) -> torch.Tensor:
    """The previous path: is_causal without cached tokens, else an explicit boolean mask."""
    chunk_len = query.shape[0]
    q = query.transpose(0, 1)
    if num_cached == 0:
        out = F.scaled_dot_product_attention(q, key, value, is_causal=True, enable_gqa=True)
    else:
        query_pos = torch.arange(num_cached, num_cached + chunk_len).unsqueeze(1)
        mask = torch.arange(num_cached + chunk_len).unsqueeze(0) <= query_pos
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, enable_gqa=True)
    return out.transpose(0, 1)


def _time(fn, rounds: int) -> float:
    start = time.perf_counter()
    for _ in range(rounds):
        fn()
    return (time.perf_counter() - start) / rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tile-rows", type=int, nargs="+", default=[512])
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.threads} threads, torch {torch.__version__}, load average {os.getloadavg()[0]:.1f}")
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for chunk_len, num_cached in SHAPES:
            context = num_cached + chunk_len
            q = torch.randn(chunk_len, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
            k = torch.randn(NUM_KV_HEADS, context, HEAD_DIM, generator=gen).to(dtype)
            v = torch.randn(NUM_KV_HEADS, context, HEAD_DIM, generator=gen).to(dtype)
            candidates = {"sdpa": lambda: sdpa_attention(q, k, v, num_cached)}
            for rows in args.tile_rows:
                candidates[f"blocked {rows}"] = lambda rows=rows: blocked_causal_attention(q, k, v, num_cached, rows)
            reference = sdpa_attention(q.float(), k.float(), v.float(), num_cached)
            best = {name: float("inf") for name in candidates}
            for _ in range(args.rounds):  # interleaved, min over rounds
                for name, fn in candidates.items():
                    fn()
                    best[name] = min(best[name], _time(fn, max(1, 64 // max(1, chunk_len // 64))))
            errors = {name: (fn().float() - reference).abs().max().item() for name, fn in candidates.items()}
            base = best["sdpa"]
            line = ", ".join(f"{n} {t * 1e3:7.2f} ms ({base / t:4.1f}x, err {errors[n]:.1e})" for n, t in best.items())
            print(f"{str(dtype)[6:]:8s} chunk {chunk_len:4d} after {num_cached:4d}: {line}")


if __name__ == "__main__":
    main()
