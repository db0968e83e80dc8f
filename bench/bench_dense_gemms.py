"""What each dense-linear GEMM costs in the runner (`--quantize none` / safetensors models): the
decode step at batch 1 and 32 and a 512-token prefill with every linear forced to one GEMM (oneDNN,
oneDNN with single rows run as two, oneDNN in K chunks, Loom's kernel), interleaved, next to what
the probe chose on this CPU.

Run: python bench/bench_dense_gemms.py [--rounds 3] [--dtype bfloat16|float32] [--random-model | --llama-1b]
         [--prefill-tokens 512]

--llama-1b: a random model of Llama 3.2 1B's shape (hidden 2048, intermediate 8192, 16 layers),
where every projection has K > 1024 (SmolLM2's only its down projections).
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
from loom_shard.layers.row_invariance import Gemm  # noqa: E402
from loom_shard.model_config import ModelConfig  # noqa: E402
from loom_shard.models import build_model  # noqa: E402
from loom_shard.runtime.model_setup import cpu_summary  # noqa: E402

LLAMA_1B_SHAPE = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
    num_heads=32, num_kv_heads=8, head_dim=64, max_position_embeddings=8192, rope_theta=500000.0,
    tie_word_embeddings=True,
)


def force(runner, gemm: Gemm | None) -> str:  # noqa: ANN001 - a ModelRunner
    """Every packed linear runs `gemm` (None: the probe's choice); returns the choices."""
    chosen: dict[str, int] = {}
    for module in runner.model.modules():
        if isinstance(module, PackedLinear):
            module.gemm = gemm
            module._packed = None  # repack for the GEMM
            name = module.chosen_gemm(module.weight.dtype).value
            chosen[name] = chosen.get(name, 0) + 1
    return ", ".join(f"{name} x{count}" for name, count in chosen.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument("--random-model", action="store_true", help="a random model of SmolLM2-135M's shape")
    shape.add_argument("--llama-1b", action="store_true", help="a random model of Llama 3.2 1B's shape")
    parser.add_argument("--prefill-tokens", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(2)
    dtype = getattr(torch, args.dtype)
    if args.llama_1b:
        torch.manual_seed(0)
        model, description = build_model(LLAMA_1B_SHAPE), "random model of Llama 3.2 1B's shape"
    else:
        model, description = load_model(args.random_model)
    runner = make_runner(model, args.dtype, 32 * -(-(300 + 64) // BLOCK_SIZE) + 64)
    print(f"model: {description}; {args.dtype}; CPU {cpu_summary()}")
    print(f"probed choice here: {force(runner, None)}")
    gemms = [Gemm.LOOM] + ([Gemm.ONEDNN, Gemm.ONEDNN_PAIRED, Gemm.ONEDNN_K_CHUNKS] if row_invariance.onednn_packs(dtype) else [])
    best: dict[tuple[str, Gemm], float] = {}
    prefill = f"prefill {args.prefill_tokens}"
    for _ in range(args.rounds):
        for gemm in gemms:
            force(runner, gemm)
            measures = {prefill: bench_prefill(runner, args.prefill_tokens, repeats=1)[0],
                        "decode b1": bench_decode(runner, 1, 16).step_ms,
                        "decode b32": bench_decode(runner, 32, 8).step_ms}
            for name, ms in measures.items():
                best[(name, gemm)] = min(best.get((name, gemm), float("inf")), ms)
    print(f"best of {args.rounds} rounds, ms (K chunks: only K > {row_invariance.K_CHUNK} is split):")
    print("| step | " + " | ".join(g.value for g in gemms) + " |")
    for name in ("decode b1", "decode b32", prefill):
        print(f"| {name} | " + " | ".join(f"{best[(name, g)]:.2f}" for g in gemms) + " |")


if __name__ == "__main__":
    main()
