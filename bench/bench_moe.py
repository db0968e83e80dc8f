"""A mixture-of-experts decode step against a dense model with the same active parameters.

Run: python bench/bench_moe.py [--threads 2] [--batches 1 32] [--rounds 3] [--dtype bfloat16]
     [--experts 8 --top-k 2 --expert-intermediate 3584 --hidden 1024 --layers 4] [--quantize none q4_1 q8_0]

Both models are random, of one shape but for the feed-forward: the MoE model's layers hold
`experts` experts of `expert-intermediate` each and route each token to `top-k` of them; the
dense model's MLP has top-k x expert-intermediate (the active parameters per token). Steps are
timed interleaved (the min over rounds), through the shard runner as in bench_engine. With
--quantize, every projection (experts and the LM head too) runs quantized on Loom's kernels, as a
GGUF's do (--quantize auto): QuantLinear, QuantExperts.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from bench.bench_engine import BLOCK_SIZE, DecodeResult, bench_decode, make_runner  # noqa: E402
from loom_shard.layers.moe import FusedExperts, QuantExperts  # noqa: E402
from loom_shard.layers.quant_linear import QuantKind, QuantLinear, QuantSource  # noqa: E402
from loom_shard.model_config import ModelConfig, MoEConfig  # noqa: E402
from loom_shard.models import build_model  # noqa: E402
from loom_shard.runtime.runner import ModelRunner  # noqa: E402


def shapes(args: argparse.Namespace) -> dict[str, ModelConfig]:
    common = dict(vocab_size=32000, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.hidden // 64,
                  num_kv_heads=args.hidden // 256, head_dim=64, max_position_embeddings=4096)
    moe = MoEConfig(num_experts=args.experts, num_experts_per_tok=args.top_k, intermediate_size=args.expert_intermediate)
    return {
        "moe": ModelConfig(architecture="MixtralForCausalLM", intermediate_size=args.expert_intermediate, moe=moe,
                           **common),
        "dense": ModelConfig(architecture="LlamaForCausalLM", intermediate_size=args.top_k * args.expert_intermediate,
                             **common),
    }


def random_model(config: ModelConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02)
    return model


def _source(weight: torch.Tensor, kind: QuantKind) -> QuantSource:
    raw = quantize(weight.float().numpy(), GGMLQuantizationType[kind.name])
    return QuantSource(kind, torch.from_numpy(np.ascontiguousarray(raw)), weight.shape[1])


def quantized(model: nn.Module, kind: QuantKind, dtype: torch.dtype) -> nn.Module:
    """Every nn.Linear (the router gate excepted) and every expert as Loom's quantized kernels run them."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if (type(child) is nn.Linear and name != "gate") or isinstance(child, FusedExperts)]
    for parent, name, child in swaps:
        if isinstance(child, FusedExperts):
            up = [QuantLinear(_source(child.w13[e].detach(), kind), None, dtype) for e in range(child.num_experts)]
            down = [QuantLinear(_source(child.w2[e].detach(), kind), None, dtype) for e in range(child.num_experts)]
            setattr(parent, name, QuantExperts(up, down, child.activation))
        else:
            setattr(parent, name, QuantLinear(_source(child.weight.detach(), kind), None, dtype))
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-intermediate", type=int, default=3584)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--quantize", default="none", choices=["none", "q4_1", "q8_0"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{os.cpu_count()} cores, {args.threads} threads, load average {os.getloadavg()[0]:.1f}; {args}")
    num_blocks = max(args.batches) * -(-(300 + 64) // BLOCK_SIZE) + 64
    runners: dict[str, ModelRunner] = {}
    for name, config in shapes(args).items():
        model = random_model(config)
        total = sum(p.numel() for p in model.parameters())
        print(f"{name}: {total / 1e6:.0f}M parameters")
        if args.quantize != "none":
            model = quantized(model, QuantKind[args.quantize.upper()], getattr(torch, args.dtype))
        runners[name] = make_runner(model, args.dtype, num_blocks)
    best: dict[tuple[str, int], DecodeResult] = {}
    for _ in range(args.rounds):
        for batch in args.batches:
            for name, runner in runners.items():
                r = bench_decode(runner, batch, num_steps=max(4, 16 // batch))
                if (name, batch) not in best or r.step_ms < best[name, batch].step_ms:
                    best[name, batch] = r
    for batch in args.batches:
        moe, dense = best["moe", batch], best["dense", batch]
        print(f"batch {batch:3d}: MoE {moe.step_ms:7.2f} ms/step, dense {dense.step_ms:7.2f} ms/step, "
              f"MoE / dense = {moe.step_ms / dense.step_ms:.2f}")


if __name__ == "__main__":
    main()
