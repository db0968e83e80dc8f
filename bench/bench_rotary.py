"""Rotary kernel A/B: the decode step with Loom's rotary CPU kernel against
the torch path (per-step cos/sin gathers, per-layer roll + mul + addcmul), interleaved in one
process so both variants see the same machine load; and, with --profile, what one decode step
spends its time on, per op kind (torch.profiler).

Run: python bench/bench_rotary.py [--dtype bfloat16] [--batches 1 32] [--pairs 5] [--profile]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine import BLOCK_SIZE, bench_decode, load_model, make_runner  # noqa: E402

from loom_shard import kernels  # noqa: E402


def ab(runner, model, batch: int, pairs: int, num_steps: int) -> dict[str, list[float]]:
    """Step times (ms) of both variants, alternating which goes first."""
    times: dict[str, list[float]] = {"kernel": [], "torch": []}
    for index in range(pairs):
        order = ["kernel", "torch"] if index % 2 == 0 else ["torch", "kernel"]
        for variant in order:
            model.rotary.use_kernel = variant == "kernel"
            times[variant].append(bench_decode(runner, batch, num_steps).step_ms)
    model.rotary.use_kernel = True
    return times


def rotary_alone(model, batch: int, dtype: torch.dtype, repeats: int = 2000) -> dict[str, float]:
    """Microseconds for one step's lookup + 30 layers' rotations, each variant."""
    import time

    attn = model.layers[0].self_attn
    heads = attn.num_heads + 2 * attn.num_kv_heads
    qkv = torch.randn(batch, heads, attn.head_dim).to(dtype)
    positions = torch.randint(150, 300, (batch,))
    out = {}
    for variant in ("kernel", "torch"):
        model.rotary.use_kernel = variant == "kernel"
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(repeats // len(model.layers)):
                rope = model.rotary.lookup(positions, 300, dtype)
                for _ in model.layers:
                    rope.apply(qkv[:, : attn.num_heads + attn.num_kv_heads])
            best = min(best, (time.perf_counter() - start) / (repeats // len(model.layers)))
        out[variant] = best * 1e6
    model.rotary.use_kernel = True
    return out


def profile_decode(runner, batch: int, num_steps: int, rows: int) -> None:
    """torch.profiler over decode steps: self CPU time per op kind, per step."""
    bench_decode(runner, batch, 4)  # warm
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        bench_decode(runner, batch, num_steps)
    # bench_decode's first two steps (admission with the context cached, then a warm step)
    # also compute one token per sequence: every profiled step is a decode step.
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=8))
    total_us = sum(e.self_cpu_time_total for e in prof.key_averages())
    steps = num_steps + 2
    print(f"profiled {steps} decode steps, batch {batch}: "
          f"{total_us / 1e3:.1f} ms self CPU in all, {sum(e.count for e in prof.key_averages()) / steps:.0f} ops/step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--pairs", type=int, default=5, help="A/B pairs per batch")
    parser.add_argument("--profile", action="store_true", help="profile batch-1 decode instead of A/B")
    parser.add_argument("--rows", type=int, default=25, help="profile table rows")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {args.threads} threads, {os.cpu_count()} cores, "
          f"kernels {'built' if kernels.available() else 'UNAVAILABLE'}, load average {os.getloadavg()[0]:.2f}")
    model, description = load_model(random_model=False)
    print(f"model: {description}, {args.dtype}")
    runner = make_runner(model, args.dtype, max(args.batches) * -(-(300 + 64) // BLOCK_SIZE) + 64)
    if args.profile:
        for batch in args.batches:
            profile_decode(runner, batch, num_steps=16, rows=args.rows)
        return
    for batch in args.batches:
        alone = rotary_alone(runner.model, batch, dtype)
        times = ab(runner, runner.model, batch, args.pairs, num_steps=max(8, 64 // batch))
        k, t = statistics.median(times["kernel"]), statistics.median(times["torch"])
        print(f"batch {batch:3d}: decode step median kernel {k:6.2f} ms, torch {t:6.2f} ms "
              f"({t / k:.3f}x); runs kernel {[round(x, 2) for x in times['kernel']]} "
              f"torch {[round(x, 2) for x in times['torch']]}; rotary alone per step (lookup + 30 layers): "
              f"kernel {alone['kernel']:.0f} us, torch {alone['torch']:.0f} us; "
              f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
