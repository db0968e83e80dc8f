"""ModelRunner on CUDA: float32 greedy parity with transformers (tiny Llama and Qwen2),
bfloat16 closeness, a mixed step of chunked prefills and decodes."""

from __future__ import annotations

import pytest
import torch

from loom_proto.config import ShardConfig
from loom_proto.step import NewRequest, RunningRequest, SamplingParams, StepPlan
from loom_shard.attention.backend import BackendKind
from loom_shard.runtime.runner import ModelRunner
from tests.unit.shard.conftest import hf_logits, make_pair, random_tokens

GREEDY = SamplingParams(seed=0, top_n_tokens=2)


def _runner(kind: str, dtype: str, cuda_graphs: bool = False) -> tuple[ModelRunner, object]:
    pair = make_pair(kind)
    config = ShardConfig(model_id="tiny", uds_path="", device="cuda", dtype=dtype, block_size=4, cuda_graphs=cuda_graphs)
    runner = ModelRunner(config, model=pair.loom)
    runner.allocate_kv_cache(num_blocks=64, num_host_blocks=8)
    return runner, pair.hf


def _generate(runner: ModelRunner, prompts: list[list[int]], num_new: int) -> list[list[int]]:
    """Prompts prefill together (the first in two chunks), then decode as one batch."""
    per_seq = 12
    news = [NewRequest(i, p, len(p), 0, len(p), list(range(i * per_seq, (i + 1) * per_seq)), sampling=GREEDY)
            for i, p in enumerate(prompts)]
    news[0].num_compute = 3  # a chunk: its prompt completes in the next step, beside decodes
    out = runner.step(StepPlan(new_requests=news)).outputs
    tokens = {o.request_id: [o.token_id] for o in out if o.token_id is not None}
    tokens[0] = []
    plan = StepPlan(running_requests=[RunningRequest(0, len(prompts[0]) - 3)] +
                    [RunningRequest(i, 1) for i in range(1, len(prompts))])
    while min(len(t) for t in tokens.values()) < num_new:
        for o in runner.step(plan).outputs:
            tokens[o.request_id].append(o.token_id)
        plan = StepPlan(running_requests=[RunningRequest(i, 1) for i in range(len(prompts))])
    return [tokens[i][:num_new] for i in range(len(prompts))]


def _greedy_reference(hf, prompt: list[int], num_new: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(num_new):
        tokens.append(int(hf_logits(hf, tokens)[-1].argmax()))
    return tokens[len(prompt):]


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama3"])
def test_float32_greedy_matches_transformers(kind: str, graphs: bool) -> None:
    runner, hf = _runner(kind, "float32", cuda_graphs=graphs)
    assert runner.attention.kind is BackendKind.TRITON
    prompts = [random_tokens(n, seed) for seed, n in enumerate([9, 5, 17, 2])]
    generated = _generate(runner, prompts, 12)
    assert generated == [_greedy_reference(hf, p, 12) for p in prompts]
    assert (runner.step_graphs is not None and runner.step_graphs.num_replays >= 10) == graphs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replay_equals_eager(dtype: str) -> None:
    """Same tokens and logprobs with and without graphs (odd batch sizes: padded buckets)."""
    results = {}
    for graphs in (False, True):
        runner, _ = _runner("llama", dtype, cuda_graphs=graphs)
        prompts = [random_tokens(n, 40 + seed) for seed, n in enumerate([8, 3, 6])]
        results[graphs] = _generate(runner, prompts, 10)
    assert results[True] == results[False]


def test_bfloat16_logprobs_stay_near_float32() -> None:
    prompt = random_tokens(20, 5)
    logprobs = {}
    for dtype in ("float32", "bfloat16"):
        runner, _ = _runner("llama", dtype)
        new = NewRequest(1, prompt, len(prompt), 0, len(prompt), [0, 1, 2, 3, 4, 5], sampling=GREEDY, prompt_logprobs=True)
        logprobs[dtype] = torch.tensor(runner.step(StepPlan(new_requests=[new])).outputs[0].prompt_logprobs)
    torch.testing.assert_close(logprobs["bfloat16"], logprobs["float32"], atol=0.1, rtol=0.05)
