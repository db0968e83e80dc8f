"""ModelRunner: steps over new and running requests, forks, swap, and plan validation."""

from __future__ import annotations

import pytest
import torch

from loom_proto.config import ShardConfig
from loom_proto.step import Fork, NewRequest, RunningRequest, SamplingParams, StepPlan
from loom_shard.runtime.runner import ModelRunner
from tests.unit.shard.conftest import hf_logits, random_tokens, tiny_runner

BLOCK_SIZE = 4
GREEDY = SamplingParams(seed=0, top_n_tokens=3)


@pytest.fixture()
def runner(llama_pair) -> ModelRunner:
    return tiny_runner(llama_pair, BLOCK_SIZE, num_blocks=32, num_host_blocks=8)


def _new(request_id: int, tokens: list[int], blocks: list[int], num_compute: int | None = None, **kw) -> NewRequest:
    kw.setdefault("sampling", GREEDY)
    n = len(tokens) if num_compute is None else num_compute
    return NewRequest(request_id, tokens, kw.pop("num_prompt_tokens", len(tokens)), kw.pop("num_cached", 0), n, blocks, **kw)


def _greedy_reference(hf, tokens: list[int], num_new: int) -> list[int]:
    tokens = list(tokens)
    for _ in range(num_new):
        tokens.append(int(hf_logits(hf, tokens)[-1].argmax()))
    return tokens[-num_new:]


def test_new_and_running_requests_generate_like_transformers(runner, llama_pair) -> None:
    p1, p2 = random_tokens(10, 11), random_tokens(7, 12)
    # Step 1: p1 prefills a partial chunk (no token), p2 its whole prompt.
    out = runner.step(StepPlan(new_requests=[_new(1, p1, [0, 1, 2, 3], num_compute=6), _new(2, p2, [5, 6])])).outputs
    assert [(o.request_id, o.token_id is None) for o in out] == [(1, True), (2, False)]
    generated = {1: [], 2: [out[1].token_id]}
    # Step 2: p1 finishes its prompt while p2 decodes.
    plan = StepPlan(running_requests=[RunningRequest(1, 4), RunningRequest(2, 1, new_block_ids=[7])])
    for step in range(4):
        for o in runner.step(plan).outputs:
            generated[o.request_id].append(o.token_id)
        plan = StepPlan(running_requests=[RunningRequest(1, 1), RunningRequest(2, 1)])
    assert generated[1] == _greedy_reference(llama_pair.hf, p1, 4)
    assert generated[2] == _greedy_reference(llama_pair.hf, p2, 5)


def test_outputs_logprob_and_top_tokens_from_raw_logits(runner, llama_pair) -> None:
    prompt = random_tokens(6, 13)
    out = runner.step(StepPlan(new_requests=[_new(1, prompt, [3, 4], prompt_logprobs=True)])).outputs[0]
    ref = torch.log_softmax(hf_logits(llama_pair.hf, prompt), dim=-1)
    assert out.logprob == pytest.approx(ref[-1].max().item(), abs=1e-4)
    assert [t.token_id for t in out.top_tokens] == ref[-1].topk(3).indices.tolist()
    expected = [ref[q, prompt[q + 1]].item() for q in range(len(prompt) - 1)]
    assert out.prompt_logprobs == pytest.approx(expected, abs=1e-4)
    # each scored prompt position's top_n_tokens alternatives (lm-eval's greedy check reads them)
    assert len(out.prompt_top_tokens) == len(prompt) - 1
    for q, top in enumerate(out.prompt_top_tokens):
        assert [t.token_id for t in top] == ref[q].topk(3).indices.tolist()
        assert [t.logprob for t in top] == pytest.approx(ref[q].topk(3).values.tolist(), abs=1e-4)


def test_fork_shares_prompt_and_copies_partial_block(runner, llama_pair) -> None:
    prompt = random_tokens(6, 14)  # 6 tokens: block 0 full, block 1 half full
    fork = Fork(request_id=2, sampling=SamplingParams(seed=1, top_n_tokens=3), block_table=[0, 9])
    out = runner.step(StepPlan(new_requests=[_new(1, prompt, [0, 1], forks=[fork])])).outputs
    assert [o.request_id for o in out] == [1, 2]
    assert out[0].token_id == out[1].token_id and out[0].logprob == out[1].logprob
    # The fork's block 9 must hold the parent's partial block: it now decodes on its own.
    parent_blocks = runner.kv_cache.device_blocks[:, :, 1, :2]
    torch.testing.assert_close(runner.kv_cache.device_blocks[:, :, 9, :2], parent_blocks)
    out = runner.step(StepPlan(running_requests=[RunningRequest(2, 1), RunningRequest(1, 1)])).outputs
    expected = _greedy_reference(llama_pair.hf, prompt, 2)[1]
    assert {o.request_id: o.token_id for o in out} == {1: expected, 2: expected}


def test_fork_on_the_chunk_that_completes_a_running_prompt(runner, llama_pair) -> None:
    prompt = random_tokens(10, 17)  # prefilled in two chunks; the fork rides on the second
    runner.step(StepPlan(new_requests=[_new(1, prompt, [0, 1, 2], num_compute=4)]))
    fork = Fork(request_id=2, sampling=SamplingParams(seed=1), block_table=[0, 1, 9])
    out = runner.step(StepPlan(running_requests=[RunningRequest(1, 6, forks=[fork])])).outputs
    assert [o.request_id for o in out] == [1, 2]
    expected = _greedy_reference(llama_pair.hf, prompt, 2)
    assert out[0].token_id == out[1].token_id == expected[0]
    out = runner.step(StepPlan(running_requests=[RunningRequest(1, 1), RunningRequest(2, 1)])).outputs
    assert {o.request_id: o.token_id for o in out} == {1: expected[1], 2: expected[1]}


def test_swap_out_and_in_preserves_logits(runner) -> None:
    prompt = random_tokens(9, 15)
    first = runner.step(StepPlan(new_requests=[_new(1, prompt, [0, 1, 2])])).outputs[0]
    tokens = prompt + [first.token_id]
    reference = runner.step(StepPlan(running_requests=[RunningRequest(1, 1)])).outputs[0]
    # Preempt: release and swap out, let another request overwrite the blocks, then resume elsewhere.
    runner.step(StepPlan(released_ids=[1], swap_out=[(0, 5), (1, 6), (2, 7)]))
    runner.step(StepPlan(new_requests=[_new(2, random_tokens(12, 16), [0, 1, 2])]))
    resumed = _new(1, tokens, [10, 11, 12], num_compute=1, num_cached=len(tokens) - 1, num_prompt_tokens=len(prompt))
    out = runner.step(StepPlan(new_requests=[resumed], swap_in=[(5, 10), (6, 11), (7, 12)])).outputs[0]
    assert (out.token_id, out.logprob) == (reference.token_id, reference.logprob)
    assert out.top_tokens == reference.top_tokens


@pytest.mark.parametrize(
    "bad_plan, message",
    [
        (StepPlan(running_requests=[RunningRequest(99, 1)]), "unknown"),
        (StepPlan(new_requests=[_new(1, [1, 2, 3], [0])]), "already exists"),
        (StepPlan(new_requests=[_new(3, [1, 2, 3, 4, 5], [0])]), "cannot hold"),
        (StepPlan(new_requests=[_new(3, [1, 2], [32])]), "outside"),
        (StepPlan(running_requests=[RunningRequest(1, 1, [1, 32])]), "outside"),  # a new block of a running one
        (StepPlan(running_requests=[RunningRequest(1, 1, [-1])]), "outside"),
        (StepPlan(running_requests=[RunningRequest(1, 2)]), "cannot compute"),
        (StepPlan(running_requests=[RunningRequest(1, 0)]), "cannot compute"),
        # drafts past its one block with no new block for them
        (StepPlan(running_requests=[RunningRequest(1, 3, draft_token_ids=[5, 6])]), "cannot hold"),
        (StepPlan(new_requests=[_new(3, [1, 2], [4])], swap_out=[(0, 8)]), "swap_out"),
        (StepPlan(new_requests=[_new(3, [1, 10_000], [4])]), "vocabulary"),
        (StepPlan(released_ids=[1], running_requests=[RunningRequest(1, 1)]), "unknown"),  # released, then run
        (StepPlan(running_requests=[RunningRequest(1, 1), RunningRequest(1, 1)]), "appears twice"),
        (StepPlan(new_requests=[_new(3, [1, 2], [4]), _new(3, [1, 2], [5])]), "already exists"),
        (StepPlan(new_requests=[_new(3, [1, 2], [4], lora_id=7)]), "serves none"),  # this shard has no LoRA
        (StepPlan(running_requests=[RunningRequest(1, 2, [4], draft_token_ids=[5])],
                  allowed_token_masks={1: b"\xff" * 8}), "drafts for a constrained request"),
    ],
)
def test_bad_plan_raises_and_changes_nothing(runner, bad_plan: StepPlan, message: str) -> None:
    runner.step(StepPlan(new_requests=[_new(1, [1, 2, 3], [0])]))
    before_requests = {rid: (list(s.token_ids), list(s.block_table), s.num_computed) for rid, s in runner.requests.items()}
    before_cache = runner.kv_cache.device_blocks.clone()
    bad_plan.swap_out = bad_plan.swap_out or [(0, 1)]  # would modify the host pool if applied
    host_before = runner.kv_cache.host_blocks.clone()
    with pytest.raises(ValueError, match=message):
        runner.step(bad_plan)
    after = {rid: (list(s.token_ids), list(s.block_table), s.num_computed) for rid, s in runner.requests.items()}
    assert after == before_requests
    assert torch.equal(runner.kv_cache.device_blocks, before_cache)
    assert torch.equal(runner.kv_cache.host_blocks, host_before)


def test_warmup_sizes_pool_from_token_budget(llama_pair) -> None:
    config = ShardConfig(model_id="tiny", uds_path="", dtype="float32", block_size=BLOCK_SIZE, host_kv_cache_bytes=10**5)
    runner = ModelRunner(config, model=llama_pair.loom)
    result = runner.warmup(max_prefill_tokens=20, max_batch_total_tokens=50)
    assert (result.num_blocks, result.block_size) == (13, BLOCK_SIZE)
    assert result.num_host_blocks == 10**5 // runner.kv_spec.bytes_per_block
    assert runner.kv_cache.num_blocks == 13
    with pytest.raises(ValueError, match="cannot hold a prefill"):
        runner.warmup(max_prefill_tokens=60, max_batch_total_tokens=50)


def test_warmup_sizes_cpu_pool_from_configured_bytes(llama_pair) -> None:
    config = ShardConfig(model_id="tiny", uds_path="", device="cpu", dtype="float32", block_size=BLOCK_SIZE,
                         cpu_kv_cache_bytes=2**20)
    runner = ModelRunner(config, model=llama_pair.loom)
    assert runner.warmup(max_prefill_tokens=8).num_blocks == 2**20 // runner.kv_spec.bytes_per_block
