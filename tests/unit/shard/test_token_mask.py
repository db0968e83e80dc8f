"""The shard's side of constrained decoding: packed allowed-token masks applied before sampling."""

from __future__ import annotations

import struct

import pytest
import torch

from loom_proto.step import SamplingParams
from loom_shard.runtime.sampler import SeqSamplingState, sample
from loom_shard.runtime.token_mask import apply_allowed_masks, check_mask, unpack_masks

VOCAB = 70  # not a multiple of 32: the last word is partly used


def pack(allowed: set[int], num_words: int | None = None) -> bytes:
    num_words = num_words or max(3, max(allowed, default=0) // 32 + 1)
    words = [0] * num_words
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return struct.pack(f"<{num_words}I", *words)


def test_unpack_matches_the_bit_layout() -> None:
    allowed = {0, 1, 31, 32, 63, 64, 69}
    bits = unpack_masks([pack(allowed), pack(set())], VOCAB, torch.device("cpu"))
    assert bits.shape == (2, VOCAB)
    assert set(bits[0].nonzero().flatten().tolist()) == allowed
    assert not bits[1].any()


def test_ids_past_a_short_mask_are_disallowed() -> None:
    bits = unpack_masks([pack({5, 33}, num_words=2)], VOCAB, torch.device("cpu"))  # covers 64 ids of 70
    assert set(bits[0].nonzero().flatten().tolist()) == {5, 33}


def test_only_masked_rows_change_and_the_input_is_untouched() -> None:
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    out = apply_allowed_masks(logits, [None, pack({7, 40}), None])
    assert torch.equal(logits, before)
    assert torch.equal(out[0], before[0]) and torch.equal(out[2], before[2])
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [7, 40]
    assert apply_allowed_masks(logits, [None, None, None]) is logits


@pytest.mark.parametrize("do_sample", [False, True])
def test_sampling_picks_only_allowed_tokens(do_sample: bool) -> None:
    torch.manual_seed(0)
    allowed = {3, 50, 66}
    for seed in range(20):
        logits = torch.randn(2, VOCAB) * 5
        states = [SeqSamplingState(SamplingParams(seed=seed, do_sample=do_sample), [1, 2], 2, pack(allowed)),
                  SeqSamplingState(SamplingParams(seed=seed, do_sample=do_sample), [1, 2], 2)]
        masked, free = sample(logits, states)
        assert masked.token_id in allowed
        # the reported logprob stays the model's own (raw logits)
        assert masked.logprob == pytest.approx(logits[0].log_softmax(-1)[masked.token_id].item(), abs=1e-5)
        if not do_sample:
            assert free.token_id == int(logits[1].argmax())


def test_a_seeded_masked_draw_is_deterministic() -> None:
    logits = torch.randn(1, VOCAB)
    state = SeqSamplingState(SamplingParams(seed=11, do_sample=True), [1], 1, pack({1, 2, 3, 4, 5}))
    assert sample(logits, [state])[0].token_id == sample(logits.clone(), [state])[0].token_id


@pytest.mark.parametrize("mask", [b"", b"\x01\x02\x03"])
def test_malformed_masks_are_rejected(mask: bytes) -> None:
    with pytest.raises(ValueError, match="int32 words"):
        check_mask(4, mask)


# ---- through the runner: new, running and forked sequences -------------------------------


@pytest.fixture()
def runner(llama_pair):  # noqa: ANN001, ANN201
    from loom_proto.config import ShardConfig
    from loom_shard.runtime.runner import ModelRunner

    r = ModelRunner(ShardConfig(model_id="tiny", uds_path="", dtype="float32", block_size=4), model=llama_pair.loom)
    r.allocate_kv_cache(num_blocks=32, num_host_blocks=4)
    return r


def test_runner_samples_inside_each_sequences_mask(runner) -> None:  # noqa: ANN001
    from loom_proto.step import Fork, NewRequest, RunningRequest, StepPlan
    from tests.unit.shard.conftest import random_tokens

    prompt = random_tokens(6, 21)
    sampling = SamplingParams(seed=1, do_sample=True)
    new = NewRequest(1, prompt, 6, 0, 6, [0, 1], sampling, forks=[Fork(2, SamplingParams(seed=2), [0, 2])])
    plain = NewRequest(3, prompt, 6, 0, 6, [3, 4], SamplingParams(seed=0))
    masks = {1: pack({10, 11}), 2: pack({12})}
    out = {o.request_id: o.token_id for o in runner.step(StepPlan([new, plain], allowed_token_masks=masks)).outputs}
    assert out[1] in {10, 11} and out[2] == 12
    free = runner.step(StepPlan(running_requests=[RunningRequest(3, 1)])).outputs[0].token_id
    step = StepPlan(running_requests=[RunningRequest(1, 1), RunningRequest(2, 1)],
                    allowed_token_masks={1: pack({40}), 2: pack({41, free})})
    out = {o.request_id: o.token_id for o in runner.step(step).outputs}
    assert out[1] == 40 and out[2] in {41, free}


def test_a_mask_for_a_request_outside_the_step_is_refused(runner) -> None:  # noqa: ANN001
    from loom_proto.step import StepPlan

    with pytest.raises(ValueError, match="not in the step"):
        runner.step(StepPlan(allowed_token_masks={9: pack({1})}))
