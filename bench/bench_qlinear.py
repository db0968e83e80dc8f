"""Quantized linears vs oneDNN bf16: one decode step's linears of the embedded model (30 layers + LM head).

Run: python bench/bench_qlinear.py [--threads 2] [--rows 1 8 32 512] [--clock cpu]
Times loom::qlinear (Q4_1 / Q8_0 kept quantized, VNNI int8 activations), torch's int4pack CPU kernel
(Q4_1 layers only) and oneDNN bf16 (PackedLinear) on the real tensors of the embedded GGUF, interleaved; best and median of repeats (the best is the fairer number
on a shared machine).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loom_shard import kernels
from loom_shard.layers.packed_linear import PackedLinear
from loom_shard.layers.quant_linear import QuantLinear, QuantSource
from loom_shard.loading.gguf_file import open_gguf, quant_source
from loom_shard.loading.loader import resolve_model_path

LAYER_TENSORS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def layer_sources(reader, layers: int) -> list[QuantSource]:
    """Per layer: qkv fused, o, gate_up fused, down; then the tied LM head."""
    out = []
    for i in range(layers):
        src = {n: quant_source(reader.tensors[f"blk.{i}.{n}.weight"], reader) for n in LAYER_TENSORS}
        out += [QuantSource.cat([src["attn_q"], src["attn_k"], src["attn_v"]]), src["attn_output"],
                QuantSource.cat([src["ffn_gate"], src["ffn_up"]]), src["ffn_down"]]
    return out + [quant_source(reader.tensors["token_embd.weight"], reader)]


def time_step(mods: list[torch.nn.Module], xs: dict[int, torch.Tensor], clock=time.perf_counter) -> float:
    start = clock()
    for m in mods:
        m(xs[m.in_features])
    return clock() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 512])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: this process's CPU time, steadier on a shared machine (use with --threads 1)")
    parser.add_argument("--skip-int4pack", action="store_true", help="leave torch's int4pack kernel out")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"kernels available: {kernels.available()}; threads {args.threads}")
    sources = layer_sources(open_gguf(resolve_model_path("")), args.layers)
    variants = {
        "qlinear vnni": [QuantLinear(s, None, torch.bfloat16) for s in sources],
        "bf16 oneDNN": [PackedLinear(_dense(s)) for s in sources],
    }
    if not args.skip_int4pack:
        variants["int4pack (Q8_0 head dense)"] = [QuantLinear(s, None, torch.bfloat16, use_kernels=False) for s in sources]
    with torch.inference_mode():
        for rows in args.rows:
            xs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in {s.in_features for s in sources}}
            times: dict[str, list[float]] = {name: [] for name in variants}
            for _ in range(args.repeats):
                for name, mods in variants.items():  # interleaved
                    times[name].append(time_step(mods, xs, clock))
            cells = ", ".join(f"{n} {min(t) * 1e3:.2f} ms (median {statistics.median(t) * 1e3:.2f})"
                              for n, t in times.items())
            print(f"rows {rows}: {cells}")


def _dense(source: QuantSource) -> torch.nn.Linear:
    linear = torch.nn.Linear(source.in_features, source.out_features, bias=False)
    linear.weight = torch.nn.Parameter(source.dequantize().to(torch.bfloat16), requires_grad=False)
    return linear


if __name__ == "__main__":
    main()
