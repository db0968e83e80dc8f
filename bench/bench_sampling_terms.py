"""The sampler's greedy log-softmax terms on a GPU: torch's ops against Loom's Triton kernel.

    python bench/bench_sampling_terms.py [--rows 1 128 256] [--vocab 49152]

Per (rows, vocab) float32 logits: the GPU time of one call (CUDA events over 200 calls in a row)
and the host's time to issue one (wall time of 200 calls without waiting for the GPU), for
torch's path in `runtime.sampler.logprob_terms` (argmax, amax, exp, sum, log) and the Triton
kernel at a few block sizes and warp counts (the first pair is the kernel's default).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from loom_shard.layers import triton_elementwise as te

CONFIGS = [(te.TERMS_BLOCK, te.TERMS_WARPS), (2048, 4), (4096, 8), (8192, 16)]  # warps <= block / 256
CALLS = 200


def torch_terms(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    row_max = logits.amax(dim=-1)
    log_sum = (logits - row_max.unsqueeze(1)).exp().sum(dim=-1).log()
    return logits.argmax(dim=-1), row_max, log_sum


def triton_terms(block: int, warps: int) -> Callable[[torch.Tensor], object]:
    return lambda logits: te.greedy_logprob_terms(logits, block, warps)


def timed(fn: Callable[[torch.Tensor], object], logits: torch.Tensor) -> tuple[float, float]:
    """(GPU µs a call, host µs to issue a call)."""
    for _ in range(5):
        fn(logits)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    wall = time.perf_counter()
    for _ in range(CALLS):
        fn(logits)
    host = (time.perf_counter() - wall) / CALLS
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / CALLS, host * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 128, 256])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results: dict[str, list[float]] = {}
    print(f"{torch.cuda.get_device_name()}; vocab {args.vocab}; GPU µs / host µs a call")
    for rows in args.rows:
        logits = torch.randn(rows, args.vocab, device="cuda") * 6
        contenders = {"torch": torch_terms} | {f"triton {b}x{w}": triton_terms(b, w) for b, w in CONFIGS}
        cells = []
        for name, fn in contenders.items():
            gpu, host = timed(fn, logits)
            results[f"{name} rows {rows}"] = [gpu, host]
            cells.append(f"{name} {gpu:.1f} / {host:.1f}")
        print(f"rows {rows}: " + "; ".join(cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
