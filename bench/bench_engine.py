"""Engine micro-benchmark: prefill and decode speed of the shard runner, next to machine ceilings.

Run: python bench/bench_engine.py [--dtypes float32 bfloat16] [--threads 2] [--random-model] [--quantize none auto]
     [--layers fused modules] [--cpu-kernels auto|avx512|avx2|off]
Decode requests enter with their context already cached (as after a prefix-cache hit),
so the numbers time the decode step itself: forward, sampling and runner bookkeeping.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from loom_proto.config import ShardConfig
from loom_proto.step import NewRequest, RunningRequest, SamplingParams, StepPlan
from loom_shard.attention.backend import TorchBackend
from loom_shard.model_config import ModelConfig
from loom_shard.models import build_model
from loom_shard.models.decoder import DecoderModel
from loom_shard.runtime.runner import ModelRunner

BLOCK_SIZE = 16
SMOLLM2_SHAPE = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
    num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192, rope_theta=100000.0,
    tie_word_embeddings=True,
)


@dataclass(slots=True)
class DecodeResult:
    batch: int
    step_ms: float  # wall clock
    cpu_ms: float  # this process's CPU time: near the wall time of an idle machine at 1 thread

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.step_ms * 1e3


def ceilings() -> dict[str, float]:
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        a, b = torch.randn(2048, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
        seconds = _best_of(lambda: a @ b, 5)
        out[f"matmul {str(dtype)[6:]} GFLOP/s"] = 2 * 2048**3 / seconds / 1e9
    src, dst = torch.empty(2**28, dtype=torch.uint8).fill_(1), torch.empty(2**28, dtype=torch.uint8)
    out["copy GB/s (read+write)"] = 2 * 2**28 / _best_of(lambda: dst.copy_(src), 5) / 1e9
    return out


def _best_of(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def load_model(random_model: bool, quantize: str = "none") -> tuple[DecoderModel, str]:
    """quantize "auto": the GGUF's Q4_1/Q8_0 projections stay quantized (QuantLinear), as a shard's default."""
    if not random_model:
        try:
            from loom_shard.loading.quantize import quantized_summary

            model = load_gguf("", quantize)
            return model, f"embedded SmolLM2-135M-Instruct (quantized: {quantized_summary(model)})"
        except Exception as error:  # the bench still runs on a random model of the same shape
            print(f"embedded model unavailable ({error}); using a random model of its shape")
    torch.manual_seed(0)
    return build_model(SMOLLM2_SHAPE), "random model of SmolLM2-135M's shape"


def load_gguf(model_id: str, quantize: str) -> DecoderModel:
    """The model as a one-rank CPU shard loads it (model_setup.load_model), in float32."""
    from loom_shard.runtime.model_setup import load_model as shard_load_model

    config = ShardConfig(model_id=model_id, uds_path="", quantize=quantize)
    return shard_load_model(config, torch.float32, torch.device("cpu"))[0]


def make_runner(model: DecoderModel, dtype: str, num_blocks: int, cpu_kernels: str = "auto") -> ModelRunner:
    config = ShardConfig(model_id="bench", uds_path="", dtype=dtype, block_size=BLOCK_SIZE, cpu_kernels=cpu_kernels)
    runner = ModelRunner(config, model=model)
    cache = runner.allocate_kv_cache(num_blocks, num_host_blocks=1)
    # Cached blocks hold real K/V in serving; never-written pages of a fresh allocation
    # read as the kernel's zero page, which made block gathers 3-8x slower than real.
    cache.device_blocks.normal_(generator=torch.Generator().manual_seed(0))
    return runner


def bench_prefill(runner: ModelRunner, num_tokens: int, repeats: int = 3) -> tuple[float, float]:
    """Best prefill wall and CPU time in ms for one prompt of num_tokens."""
    tokens = [random.randrange(1000, 20000) for _ in range(num_tokens)]
    blocks = list(range(-(-num_tokens // BLOCK_SIZE)))
    best, best_cpu = float("inf"), float("inf")
    for i in range(repeats + 1):
        new = NewRequest(i, tokens, num_tokens, 0, num_tokens, blocks, SamplingParams(seed=i))
        start, cpu_start = time.perf_counter(), time.process_time()
        runner.step(StepPlan(new_requests=[new]))
        if i:  # the first run warms up
            best = min(best, time.perf_counter() - start)
            best_cpu = min(best_cpu, time.process_time() - cpu_start)
        runner.release([i])
    return best * 1e3, best_cpu * 1e3


def bench_decode(runner: ModelRunner, batch: int, num_steps: int) -> DecodeResult:
    """Mean decode step time for `batch` requests with 150-300 cached tokens each."""
    rng = random.Random(batch)
    blocks_per_seq = -(-(300 + num_steps + 2) // BLOCK_SIZE)
    news = []
    for i in range(batch):
        context = rng.randrange(150, 301)
        tokens = [rng.randrange(1000, 20000) for _ in range(context)]
        table = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
        news.append(NewRequest(i, tokens, context, context - 1, 1, table, SamplingParams(seed=i)))
    runner.step(StepPlan(new_requests=news))
    plan = StepPlan(running_requests=[RunningRequest(i, 1) for i in range(batch)])
    runner.step(plan)  # warm
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(num_steps):
        runner.step(plan)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    runner.clear()
    return DecodeResult(batch, elapsed / num_steps * 1e3, cpu / num_steps * 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--random-model", action="store_true")
    parser.add_argument("--attention", nargs="+", default=["default"], choices=["default", "torch"],
                        help="CPU attention backends to A/B, interleaved (default: select_backend's choice)")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds; each line prints its min")
    parser.add_argument("--quantize", nargs="+", default=["none"], choices=["none", "auto"],
                        help="weights dequantized (none) or kept quantized (auto); several: interleaved per batch")
    parser.add_argument("--layers", nargs="+", default=["fused"], choices=["fused", "modules"],
                        help="quantized layers in one C++ call (loom::decoder_layers) or module by module; interleaved")
    parser.add_argument("--cpu-kernels", default="auto", help="the kernels build (as loom-launcher's flag)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {args.threads} threads, "
          f"load average {os.getloadavg()[0]:.1f} (other processes share these cores)")
    for name, value in ceilings().items():
        print(f"ceiling  {name:28s} {value:8.1f}")
    models = {}
    for quantize in args.quantize:
        models[quantize], description = load_model(args.random_model, quantize)
        print(f"model --quantize {quantize}: {description}")
    num_blocks = max(args.batches) * -(-(300 + 64) // BLOCK_SIZE) + 64
    for dtype in args.dtypes:
        for quantize, model in models.items():  # --quantize x --attention, interleaved over rounds
            runner = make_runner(model, dtype, num_blocks, args.cpu_kernels)
            backends = {(name, layers): runner.attention if name == "default" else TorchBackend(runner.device)
                        for name in args.attention for layers in args.layers}
            prefill: dict[tuple[str, str], tuple[float, float]] = {}
            decode: dict[tuple[tuple[str, str], int], DecodeResult] = {}
            for _ in range(args.rounds):  # interleaved A/B, min over rounds
                for name, backend in backends.items():
                    runner.attention = backend
                    model.fused_layers.enabled = name[1] == "fused"
                    p = bench_prefill(runner, 512, repeats=2)
                    prefill[name] = min(prefill.get(name, p), p)
                    for batch in args.batches:
                        r = bench_decode(runner, batch, num_steps=max(8, 32 // batch))
                        if (name, batch) not in decode or r.step_ms < decode[name, batch].step_ms:
                            decode[name, batch] = r
            for name, backend in backends.items():
                label = f"{dtype:9s} {quantize:4s} [{backend.kind.value}, {name[1]}]"
                prefill_ms, prefill_cpu_ms = prefill[name]
                print(f"{label} prefill 512 tokens: {prefill_ms:7.1f} ms = {512 / prefill_ms * 1e3:7.0f} tokens/s "
                      f"(cpu {prefill_cpu_ms:7.1f} ms = {512 / prefill_cpu_ms * 1e3:7.0f} tokens/s)")
                for batch in args.batches:
                    r = decode[name, batch]
                    print(f"{label} decode batch {batch:3d}: {r.step_ms:7.2f} ms/step = {1e3 / r.step_ms:6.1f} steps/s, "
                          f"{r.tokens_per_s:7.1f} tokens/s (cpu {r.cpu_ms:7.2f} ms/step = {r.batch / r.cpu_ms * 1e3:7.1f} tokens/s)")
            del runner

if __name__ == "__main__":
    main()
