"""Loom's C++ CPU kernels (`loom_shard.kernels`): correct against torch, and batch-invariant."""

from __future__ import annotations

import pytest
import torch

from loom_shard import kernels
from loom_shard.layers.norm import RMSNorm

pytestmark = pytest.mark.usefixtures("kernel_isa")  # once per build this CPU runs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_float32_torch(dtype: torch.dtype) -> None:
    x, weight = torch.randn(9, 576).to(dtype), torch.randn(576).to(dtype)
    expected = torch.rms_norm(x.float(), (576,), weight.float(), 1e-5)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(kernels.rms_norm(x, weight, 1e-5).float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_row_is_bit_identical_at_any_batch(dtype: torch.dtype) -> None:
    x, weight = torch.randn(64, 576).to(dtype), torch.randn(576).to(dtype)
    alone = torch.cat([kernels.rms_norm(x[i : i + 1], weight, 1e-6) for i in range(64)])
    for rows in (1, 7, 64):
        assert torch.equal(kernels.rms_norm(x[:rows], weight, 1e-6), alone[:rows])


def test_rms_norm_module_uses_the_kernel_on_cpu() -> None:
    norm = RMSNorm(576, 1e-5)
    norm.weight.data.normal_()
    x = torch.randn(3, 576, dtype=torch.bfloat16)
    norm = norm.to(torch.bfloat16)
    assert torch.equal(norm(x), kernels.rms_norm(x, norm.weight, 1e-5))


def test_rms_norm_rejects_a_wrong_weight() -> None:
    with pytest.raises(RuntimeError, match="weight must be"):
        kernels.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-5)



@pytest.mark.parametrize("vocab", [49152, 1003, 7])
def test_greedy_logprob_terms_match_argmax_and_log_softmax(vocab: int) -> None:
    logits = torch.randn(6, vocab) * 6
    logits[1, 5] = logits[1, vocab - 1] = logits[1].max() + 1  # a tie: the first index wins, as torch's
    logits[2, 3:] = float("-inf")  # masked tokens
    argmax, row_max, log_sum = kernels.ops().greedy_logprob_terms(logits)
    assert torch.equal(argmax, logits.argmax(dim=-1))
    torch.testing.assert_close((logits - row_max[:, None]) - log_sum[:, None], logits.log_softmax(-1), atol=2e-6, rtol=1e-6)


def test_greedy_logprob_terms_of_a_row_are_bit_identical_at_any_batch() -> None:
    logits = torch.randn(32, 49152) * 6
    alone = [kernels.ops().greedy_logprob_terms(logits[i : i + 1]) for i in range(32)]
    for rows in (1, 7, 32):
        batch = kernels.ops().greedy_logprob_terms(logits[:rows])
        for i in range(rows):
            assert all(torch.equal(got[i], one[0]) for got, one in zip(batch, alone[i]))


def test_greedy_logprob_terms_pick_a_nan_as_torch_does() -> None:
    logits = torch.randn(3, 100)
    logits[:, 7] = 50.0  # the max comes before each NaN
    logits[0, 40] = logits[1, 98] = float("nan")  # in the SIMD body, in the scalar tail
    argmax, _, log_sum = kernels.ops().greedy_logprob_terms(logits)
    assert argmax.tolist() == logits.argmax(dim=-1).tolist() == [40, 98, 7]
    assert log_sum.isnan().tolist() == [True, True, False]


def _lora_case(dtype: torch.dtype, in_features: int, outs: list[int], rank: int = 8, slots: int = 4):
    """Tokens of three adapters and the base model (-1), and factors in the slot layout LoraSlots uses."""
    gen = torch.Generator().manual_seed(in_features)
    token_slot = torch.tensor([2, -1, 0, 2, 3, -1, 0, 0, 2, 3, 3])
    x = torch.randn(len(token_slot), in_features, generator=gen).to(dtype)
    a = (torch.randn(slots, len(outs) * rank, in_features, generator=gen) * 0.2).to(dtype)
    b = [(torch.randn(slots, rank, out, generator=gen) * 0.2).to(dtype) for out in outs]
    return x, a, b, token_slot


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features, outs", [(576, [576, 192, 192]), (72, [40]), (19, [33, 16])])
def test_lora_shrink_and_expand_match_float64(dtype: torch.dtype, in_features: int, outs: list[int]) -> None:
    """Each adapter token gets x @ A[slot].T @ B[slot] added (base tokens nothing), on shapes with and
    without a 16-lane tail."""
    x, a, b, token_slot = _lora_case(dtype, in_features, outs)
    h = kernels.ops().lora_shrink(x, a, token_slot)
    out = torch.randn(len(token_slot), sum(outs)).to(dtype)
    expected_h = torch.zeros(len(token_slot), a.shape[1], dtype=torch.float64)
    expected = out.double()
    for t, slot in enumerate(token_slot.tolist()):
        if slot >= 0:
            expected_h[t] = x[t].double() @ a[slot].double().T
            parts = [expected_h[t, p * 8 : (p + 1) * 8] @ part[slot].double() for p, part in enumerate(b)]
            expected[t] += torch.cat(parts)
    torch.testing.assert_close(h.double(), expected_h, atol=1e-5, rtol=1e-5)
    assert kernels.ops().lora_expand_(out, h, b, token_slot) is out
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # out rounded to bfloat16 once
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


def test_lora_delta_of_a_token_is_bit_identical_in_any_batch() -> None:
    x, a, b, token_slot = _lora_case(torch.bfloat16, 576, [576, 192, 192])
    base = torch.randn(len(token_slot), 960).to(torch.bfloat16)
    batch = kernels.ops().lora_expand_(base.clone(), kernels.ops().lora_shrink(x, a, token_slot), b, token_slot)
    for t in range(len(token_slot)):
        row = slice(t, t + 1)
        alone = kernels.ops().lora_expand_(base[row].clone(), kernels.ops().lora_shrink(x[row], a, token_slot[row]),
                                           b, token_slot[row])
        assert torch.equal(alone, batch[row])


def test_lora_kernels_refuse_a_slot_out_of_range() -> None:
    x, a, _, _ = _lora_case(torch.float32, 72, [40])
    with pytest.raises(RuntimeError, match="slot 4 out of range"):
        kernels.ops().lora_shrink(x, a, torch.full((len(x),), 4))


def test_lora_expand_rounds_to_bfloat16_as_torch_does() -> None:
    """A bfloat16 output is the float32 one rounded as torch rounds (nearest, ties to even), in the
    16-lane body and the scalar tail alike; a NaN stays a NaN (c10's 0x7FC0 where torch's vectorized
    conversion writes 0xFFFF)."""
    x, a, b, token_slot = _lora_case(torch.bfloat16, 72, [40, 19])
    shrunk = kernels.ops().lora_shrink(x, a, token_slot)
    out = (torch.randn(len(token_slot), 59) * 100).to(torch.bfloat16).float()  # the same values either way
    out[4, 3] = out[9, 50] = float("nan")
    as_float = kernels.ops().lora_expand_(out.clone(), shrunk, [part.float() for part in b], token_slot)
    as_bf16 = kernels.ops().lora_expand_(out.to(torch.bfloat16), shrunk, b, token_slot)
    nan = as_float.isnan()
    assert nan.sum() == 2 and torch.equal(as_bf16.isnan(), nan)
    assert torch.equal(as_bf16[~nan].view(torch.int16), as_float[~nan].to(torch.bfloat16).view(torch.int16))
