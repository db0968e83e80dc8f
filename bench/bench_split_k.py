"""What splitting bfloat16 linears with K > 1024 into K chunks costs (issue 14): the runner's decode
step at batch 1 and 32, and a 512-token prefill, with the split forced off and on, interleaved.

Run: python bench/bench_split_k.py [--rounds 3] [--random-model]
On a CPU whose oneDNN is row-invariant at every K (the probe says so) the default never splits,
so "off" is the default there; "on" is what a CPU that needs the split pays.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine import BLOCK_SIZE, bench_decode, bench_prefill, load_model, make_runner  # noqa: E402

from loom_shard.layers import row_invariance  # noqa: E402
from loom_shard.layers.packed_linear import PackedLinear  # noqa: E402


def set_split(runner, split: bool) -> int:  # noqa: ANN001 - a ModelRunner
    """Force every packed linear's split; returns how many linears have K > MAX_INVARIANT_K."""
    count = 0
    for module in runner.model.modules():
        if isinstance(module, PackedLinear):
            module.split_k = split
            module._packed = None  # repack with the new chunking
            count += module.in_features > row_invariance.MAX_INVARIANT_K
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--random-model", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, description = load_model(args.random_model)
    runner = make_runner(model, "bfloat16", 32 * -(-(300 + 64) // BLOCK_SIZE) + 64)
    print(f"model: {description}; oneDNN needs the split here: {row_invariance.onednn_needs_split(1536, 576)}")
    best: dict[tuple[str, bool], float] = {}
    for _ in range(args.rounds):
        for split in (False, True):
            split_layers = set_split(runner, split)
            measures = {"prefill 512": bench_prefill(runner, 512, repeats=1)[0],
                        "decode b1": bench_decode(runner, 1, 16).step_ms,
                        "decode b32": bench_decode(runner, 32, 8).step_ms}
            for name, ms in measures.items():
                best[(name, split)] = min(best.get((name, split), float("inf")), ms)
    print(f"{split_layers} linears have K > {row_invariance.MAX_INVARIANT_K}; best of {args.rounds} rounds, ms:")
    for name in ("decode b1", "decode b32", "prefill 512"):
        off, on = best[(name, False)], best[(name, True)]
        print(f"{name:12s} one GEMM {off:8.2f}  K-split {on:8.2f}  ({(on / off - 1) * 100:+.1f}%)")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
