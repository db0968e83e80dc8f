"""GPU benchmark of the shard's runner (one CUDA device): decode tokens/s at several batch
sizes (steps one at a time, and each launched before the one before it finishes), a step of
decodes with one new prompt replayed as its graph and run eagerly, prefill
tokens/s, the GPU's own ceilings, and transformers on the same GPU and model;
batch 1 and 32 again with torch's elementwise ops in place of the Triton kernels (A/B), and a
Llama-1B shape against its weight-read floor and the bf16 peak.

The model is SmolLM2-135M's architecture (the embedded model's config) with random bf16
weights: speed does not depend on the weights' values, and no file has to travel.
Usage: python bench/bench_gpu.py [--out results.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from loom_proto.config import ShardConfig
from loom_proto.step import NewRequest, RunningRequest, SamplingParams, StepPlan
from loom_shard.layers import elementwise
from loom_shard.loading.hf_folder import config_from_hf
from loom_shard.models import build_model
from loom_shard.runtime.runner import ModelRunner

SMOLLM2 = dict(  # MODEL-NOTES.md: the embedded GGUF's metadata
    architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
    rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
)
# A Llama-3.2-1B-shaped model (hidden 2048, 16 layers): the "1B shape" for the decode floor and
# prefill efficiency.
LLAMA_1B = dict(
    architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=2048, intermediate_size=8192,
    num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
)
PROMPT_LEN = 128
DECODE_STEPS = 64
BLOCK_SIZE = 16
PROFILE_STEPS = 20  # host_profile's steps after decode_rate's
# Blocks per sequence: the prompt, decode_rate's steps, then host_profile's
SEQ_BLOCKS = -(-(PROMPT_LEN + DECODE_STEPS + PROFILE_STEPS + 8) // BLOCK_SIZE)
GREEDY = SamplingParams(seed=0)


def cuda_time(fn: Callable[[], object], repeat: int = 10) -> float:
    """Median seconds of fn() over repeats, timed with CUDA events after one warm-up."""
    fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def ceilings() -> dict[str, float]:
    src = torch.randn(2**28, device="cuda")  # 1 GiB of float32, random (never time zeros)
    dst = torch.empty_like(src)
    copy_s = cuda_time(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_s = cuda_time(lambda: a @ b)
    return {"d2d_copy_GBps": 2 * src.numel() * 4 / copy_s / 1e9, "bf16_matmul_TFLOPs": 2 * 8192**3 / mm_s / 1e12}


def make_runner(cuda_graphs: bool, max_batch: int, hf_config: dict | None = None) -> ModelRunner:
    torch.manual_seed(0)
    model = build_model(config_from_hf(hf_config or SMOLLM2))
    config = ShardConfig(model_id="bench", uds_path="", device="cuda", dtype="bfloat16", block_size=BLOCK_SIZE,
                         cuda_graphs=cuda_graphs, host_kv_cache_bytes=0)
    runner = ModelRunner(config, model=model)
    # one sequence's blocks more than the batch: mixed_step_ms's new prompts
    runner.warmup(max_prefill_tokens=4096, max_batch_total_tokens=max((max_batch + 1) * SEQ_BLOCKS, 512) * BLOCK_SIZE)
    return runner


def new_request(request_id: int, tokens: list[int], blocks_per_seq: int) -> NewRequest:
    """A greedy request prefilling all of `tokens`, in blocks of its own (request_id's range)."""
    first = request_id * blocks_per_seq
    return NewRequest(request_id, tokens, len(tokens), 0, len(tokens), list(range(first, first + blocks_per_seq)),
                      sampling=GREEDY)


def decode_rate(runner: ModelRunner, batch: int, launch_ahead: bool = False) -> float:
    """Tokens/s of DECODE_STEPS decode steps over `batch` sequences of PROMPT_LEN tokens; with
    `launch_ahead` each step is launched before the one before it finishes (as the server runs
    the steps the router sends ahead), else one `step` at a time."""
    runner.clear()
    gen = torch.Generator().manual_seed(batch)
    for first in range(0, batch, 16):  # prefill 16 sequences a step
        news = [new_request(i, torch.randint(0, 49152, (PROMPT_LEN,), generator=gen).tolist(), SEQ_BLOCKS)
                for i in range(first, min(first + 16, batch))]
        runner.step(StepPlan(new_requests=news))
    plan = StepPlan(running_requests=[RunningRequest(i, 1) for i in range(batch)])
    for _ in range(3):
        runner.step(plan)
    torch.cuda.synchronize()
    start = time.perf_counter()
    if launch_ahead:
        previous = runner.launch(plan)
        for _ in range(DECODE_STEPS - 5):
            launched = runner.launch(plan)
            runner.finish(previous)
            previous = launched
        runner.finish(previous)
    else:
        for _ in range(DECODE_STEPS - 4):
            runner.step(plan)
    elapsed = time.perf_counter() - start  # each step returns host tokens: already synchronized
    return batch * (DECODE_STEPS - 4) / elapsed


def prefill_rate(runner: ModelRunner, num_tokens: int, num_seqs: int = 1) -> float:
    per_seq = -(-num_tokens // BLOCK_SIZE)
    times = []
    for rep in range(6):
        runner.clear()
        news = [new_request(i, torch.randint(0, 49152, (num_tokens,)).tolist(), per_seq) for i in range(num_seqs)]
        torch.cuda.synchronize()
        start = time.perf_counter()
        runner.step(StepPlan(new_requests=news))
        times.append(time.perf_counter() - start)
    return num_tokens * num_seqs / statistics.median(times[1:])


def graph_rates(runner: ModelRunner, tag: str, batches: list[int]) -> dict[str, float]:
    """Decode tokens/s at each batch and the GPU's own time per step (the captured graph's replay):
    what the host adds shows beside it."""
    results = {}
    for batch in batches:
        results[f"{tag}_decode_tok_s_b{batch}"] = decode_rate(runner, batch)
        results[f"{tag}_launch_ahead_decode_tok_s_b{batch}"] = decode_rate(runner, batch, launch_ahead=True)
        results[f"{tag}_graph_replay_ms_b{batch}"] = cuda_time(runner.step_graphs.steps[batch].graph.replay, 20) * 1e3
    return results


def mixed_step_ms(runner: ModelRunner, batch: int, prompt_len: int = 20, steps: int = 10) -> dict[str, float]:
    """A step of `batch` decodes that also prefills one new `prompt_len`-token prompt (a step while
    requests keep arriving): median ms with its CUDA graph and eagerly, alternating, in one runner."""
    decode_rate(runner, batch)  # leaves `batch` sequences decoding, with room for 28 tokens more each
    graphs = runner.step_graphs
    decodes = [RunningRequest(i, 1) for i in range(batch)]
    spare = list(range(batch * SEQ_BLOCKS, batch * SEQ_BLOCKS + -(-prompt_len // BLOCK_SIZE)))
    times: dict[str, list[float]] = {"graph": [], "eager": []}
    released: list[int] = []
    for step in range(2 * steps):
        mode = ("graph", "eager")[step % 2]
        runner.step_graphs = graphs if mode == "graph" else None
        request_id = 100_000 + step
        prompt = torch.randint(0, 49152, (prompt_len,)).tolist()
        new = NewRequest(request_id, prompt, prompt_len, 0, prompt_len, spare, sampling=GREEDY)
        torch.cuda.synchronize()
        start = time.perf_counter()
        runner.step(StepPlan(new_requests=[new], running_requests=decodes, released_ids=released))
        times[mode].append(time.perf_counter() - start)  # tokens on the host: synchronized
        released = [request_id]
    runner.step_graphs = graphs
    runner.release(released)
    return {f"loom_mixed_step_ms_b{batch}_{mode}": statistics.median(t[1:]) * 1e3 for mode, t in times.items()}


def torch_elementwise_rates() -> dict[str, float]:
    """The same graphs with torch's elementwise ops instead of the Triton kernels (the A side)."""
    elementwise.TRITON = False
    try:
        return graph_rates(make_runner(True, 32), "loom_torch_elementwise", [1, 32])
    finally:
        elementwise.TRITON = True


def weight_bytes(runner: ModelRunner) -> int:
    """Bytes a decode step reads at least: every parameter once (a tied embedding once)."""
    return sum(p.numel() * p.element_size() for p in runner.model.parameters())


def one_b_shape(copy_GBps: float, matmul_TFLOPs: float, profile_out: str | None = None) -> dict[str, float]:
    """The 1B shape: batch-1 decode step (graph replay) against its weight-read floor, and one
    2,048-token prefill against the bf16 matmul peak measured in this run (its kernels' GPU time
    to `profile_out`)."""
    runner = make_runner(True, 32, LLAMA_1B)
    results: dict[str, float] = {"llama1b_weight_GB": weight_bytes(runner) / 1e9}
    results |= graph_rates(runner, "llama1b", [1, 32])
    floor_ms = weight_bytes(runner) / (copy_GBps * 1e9) * 1e3
    results["llama1b_weight_read_floor_ms"] = floor_ms
    results["llama1b_b1_replay_over_floor"] = results["llama1b_graph_replay_ms_b1"] / floor_ms
    tokens = 2048
    rate = prefill_rate(runner, tokens)
    mc = runner.model.config
    embed = mc.vocab_size * mc.hidden_size
    dense_params = sum(p.numel() for p in runner.model.parameters()) - embed
    flops = 2 * dense_params * tokens + 2 * embed + mc.num_layers * 2 * tokens**2 * mc.num_heads * mc.head_dim
    results["llama1b_prefill_tok_s_2048"] = rate
    results["llama1b_prefill_TFLOPs_2048"] = flops * rate / tokens / 1e12
    results["llama1b_prefill_share_of_peak"] = results["llama1b_prefill_TFLOPs_2048"] / matmul_TFLOPs
    if profile_out:
        with open(profile_out, "w") as f:
            f.write(prefill_profile(runner, tokens))
    print({k: round(v, 4) for k, v in results.items()}, flush=True)
    return results


def host_profile(runner: ModelRunner, batch: int, steps: int = PROFILE_STEPS) -> str:
    """Where a graph decode step's host time goes at `batch` sequences: cProfile over `steps`
    steps, the top functions by their own time and by cumulative time."""
    import cProfile
    import io
    import pstats

    decode_rate(runner, batch)  # leaves `batch` sequences decoding
    plan = StepPlan(running_requests=[RunningRequest(i, 1) for i in range(batch)])
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        runner.step(plan)
    profiler.disable()
    out = io.StringIO()
    for order in ("tottime", "cumulative"):
        pstats.Stats(profiler, stream=out).sort_stats(order).print_stats(30)
    return out.getvalue()


def kernel_table(steps: Callable[[], object], rows: int = 25) -> str:
    """The GPU time of what `steps` runs, by kernel, as torch.profiler sums it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        steps()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows)


def prefill_profile(runner: ModelRunner, num_tokens: int) -> str:
    """One `num_tokens` prefill by kernel (GEMMs, attention, elementwise)."""
    runner.clear()
    plan = StepPlan(new_requests=[new_request(0, list(range(1, num_tokens + 1)), -(-num_tokens // BLOCK_SIZE))])
    return kernel_table(lambda: runner.step(plan))


def kernel_profile(runner: ModelRunner) -> str:
    """Five eager batch-1 decode steps by kernel."""
    runner.clear()
    runner.step(StepPlan(new_requests=[new_request(0, list(range(1, PROMPT_LEN + 1)),
                                                   -(-(PROMPT_LEN + 16) // BLOCK_SIZE))]))
    plan = StepPlan(running_requests=[RunningRequest(0, 1)])
    runner.step(plan)
    return kernel_table(lambda: [runner.step(plan) for _ in range(5)])


def transformers_rates(batches: list[int]) -> dict[str, float]:
    """transformers' own generate (static batch, greedy) on the same architecture, bf16."""
    import transformers

    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(**{k: v for k, v in SMOLLM2.items() if k != "architectures"})
    model = transformers.LlamaForCausalLM(hf_config).to("cuda", torch.bfloat16).eval()
    rates: dict[str, float] = {}
    for batch in batches:
        ids = torch.randint(0, 49152, (batch, PROMPT_LEN), device="cuda")

        def run(n: int) -> float:
            torch.cuda.synchronize()
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
            return time.perf_counter() - start

        run(4)
        prefill_only, full = run(1), run(DECODE_STEPS)
        rates[f"hf_generate_decode_tok_s_b{batch}"] = batch * (DECODE_STEPS - 1) / (full - prefill_only)
    try:
        rates |= _generate_batch_rates(hf_config, [b for b in batches if b in (32, 128)])
    except Exception as error:  # noqa: BLE001 - continuous batching is newer API; record why not
        rates["hf_generate_batch_error"] = repr(error)[:300]
    return rates


def _generate_batch_rates(hf_config, batches: list[int]) -> dict[str, float]:  # noqa: ANN001
    """transformers' continuous batching (`generate_batch`, paged attention), tokens/s end to end."""
    import transformers

    torch.manual_seed(0)
    errors = []
    for attention in ("paged|sdpa", "paged|eager", "sdpa_paged"):  # the names transformers 5 and 4.5x accept
        try:
            model = transformers.LlamaForCausalLM._from_config(hf_config, attn_implementation=attention)
            break
        except (ValueError, ImportError) as error:
            errors.append(f"{attention}: {error!r}"[:200])
    else:
        raise RuntimeError("; ".join(errors))
    model = model.to("cuda", torch.bfloat16).eval()
    config = transformers.GenerationConfig(max_new_tokens=DECODE_STEPS, do_sample=False, eos_token_id=-1,
                                           pad_token_id=0, use_cuda_graph=False)
    rates = {}
    for batch in batches:
        inputs = [torch.randint(1, 49152, (PROMPT_LEN,)).tolist() for _ in range(batch)]
        model.generate_batch(inputs=inputs[:2], generation_config=config)  # warm
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate_batch(inputs=inputs, generation_config=config)
        torch.cuda.synchronize()
        rates[f"hf_generate_batch_tok_s_b{batch}"] = batch * DECODE_STEPS / (time.perf_counter() - start)
    rates["hf_generate_batch_attention"] = attention
    return rates


def peer_rates(results: dict, batches: list[int], prefill_profile_out: str | None) -> dict[str, float | str]:
    """torch's elementwise ops, the 1B shape against the GPU's ceilings, and transformers."""
    results = dict(results)
    results |= torch_elementwise_rates()
    print({k: round(v, 3) for k, v in results.items() if "torch_elementwise" in k}, flush=True)
    torch.cuda.empty_cache()
    try:
        results |= one_b_shape(results["d2d_copy_GBps"], results["bf16_matmul_TFLOPs"], prefill_profile_out)
    except Exception as error:  # noqa: BLE001 - record why, keep the rest of the run
        results["llama1b_error"] = repr(error)[:300]
    torch.cuda.empty_cache()
    try:
        results |= transformers_rates(batches)
    except Exception as error:  # noqa: BLE001 - the comparison is optional; say why it is missing
        results["hf_error"] = repr(error)[:300]
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true", help="fewer batch sizes (a smoke run)")
    parser.add_argument("--profile-out", default=None, help="write batch 1's per-kernel GPU time table here")
    parser.add_argument("--prefill-profile-out", default=None, help="write the 1B shape's prefill kernels here")
    parser.add_argument("--host-profile-out", default=None, help="write the widest batch's host cProfile here")
    parser.add_argument("--runner-only", action="store_true", help="the runner with CUDA graphs alone: no eager "
                        "runner, torch's elementwise ops, 1B shape or transformers (a short lease)")
    args = parser.parse_args()
    batches = [1, 32] if args.quick else [1, 32, 128, 256]
    results: dict[str, float | str] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    results |= ceilings()
    for graphs in (True,) if args.runner_only else (True, False):
        runner = make_runner(graphs, max(batches))
        if graphs:
            results |= graph_rates(runner, "loom_graphs", batches)
            for batch in batches:
                results |= mixed_step_ms(runner, batch)
        else:
            results |= {f"loom_eager_decode_tok_s_b{batch}": decode_rate(runner, batch) for batch in batches}
        print({k: round(v, 2) for k, v in results.items() if isinstance(v, float)}, flush=True)
        if graphs and args.host_profile_out:
            with open(args.host_profile_out, "w") as f:
                f.write(host_profile(runner, max(batches)))
        if graphs:
            results["loom_prefill_tok_s_2048x1"] = prefill_rate(runner, 2048)
            results["loom_prefill_tok_s_2048x2"] = prefill_rate(runner, 2048, num_seqs=2)
        elif args.profile_out:
            try:
                table = kernel_profile(runner)
            except Exception as error:  # noqa: BLE001 - the profile is a diagnosis; keep the run
                table = repr(error)
            with open(args.profile_out, "w") as f:
                f.write(table)
        del runner
        torch.cuda.empty_cache()
    if not args.runner_only:
        results |= peer_rates(results, batches, args.prefill_profile_out)
    print(json.dumps(results, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
