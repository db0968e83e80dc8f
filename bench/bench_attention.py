"""Attention on CPU, interleaved A/B, min of rounds.

Run: python bench/bench_attention.py [--threads 2] [--tile-rows 256 512 1024]
     python bench/bench_attention.py --paged   (one layer's paged_attention: the torch paths vs
     the C++ paged kernel, decode at batch 1/8/32 with 150-300 cached tokens, prefill 512/2000)
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

from loom_shard.attention.backend import BackendKind, PagedBackend, TorchBackend
from loom_shard.attention.metadata import AttentionSpec, SeqSpan
from loom_shard.attention.torch_paged import blocked_causal_attention, paged_attention

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
    parser.add_argument("--paged", action="store_true", help="torch paths vs the C++ paged kernel, one layer")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.threads} threads, torch {torch.__version__}, load average {os.getloadavg()[0]:.1f}")
    if args.paged:
        bench_paged(args.rounds)
        return
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


PAGED_CASES = {"decode b=1": [1], "decode b=8": [1] * 8, "decode b=32": [1] * 32, "prefill 512": [512],
               "prefill 2000": [2000]}


def bench_paged(rounds: int) -> None:
    """One layer's `paged_attention` (cache write + attention) with each backend's metadata."""
    from loom_shard import kernels
    from loom_shard.attention.cpu import paged_attention_cpu

    if not kernels.available():
        raise SystemExit("Loom's CPU kernels could not be built here")
    backends = {"torch": TorchBackend(torch.device("cpu")),
                "cpu_paged": PagedBackend(torch.device("cpu"), paged_attention_cpu, BackendKind.CPU_PAGED)}
    block_size, rng = 16, torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for case, computes in PAGED_CASES.items():
            lengths = torch.randint(150, 301, (len(computes),), generator=rng).tolist()
            spans, next_block = [], 0
            for compute, context in zip(computes, lengths):
                cached = context if compute == 1 else 0
                need = -(-(cached + compute) // block_size)
                spans.append(SeqSpan(cached, compute, list(range(next_block, next_block + need))))
                next_block += need
            kv = torch.randn(2, next_block, block_size, NUM_KV_HEADS, HEAD_DIM, generator=rng).to(dtype)
            tokens = sum(computes)
            q = torch.randn(tokens, NUM_HEADS, HEAD_DIM, generator=rng).to(dtype)
            k = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, generator=rng).to(dtype)
            v = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, generator=rng).to(dtype)
            metas = {name: b.build_metadata(spans, block_size) for name, b in backends.items()}
            spec = AttentionSpec.plain(HEAD_DIM)
            fns = {name: (lambda m=m: paged_attention(q, k, v, kv, m, spec)) for name, m in metas.items()}
            best = {name: float("inf") for name in fns}
            repeats = max(1, 200 // max(1, tokens // 16))
            for _ in range(rounds):
                for name, fn in fns.items():
                    fn()
                    best[name] = min(best[name], _time(fn, repeats))
            diff = (fns["torch"]().float() - fns["cpu_paged"]().float()).abs().max().item()
            line = ", ".join(f"{n} {t * 1e6:9.1f} us" for n, t in best.items())
            print(f"{str(dtype)[6:]:8s} {case:13s}: {line}  (torch / paged {best['torch'] / best['cpu_paged']:5.2f}x, "
                  f"max diff {diff:.1e})")


if __name__ == "__main__":
    main()
