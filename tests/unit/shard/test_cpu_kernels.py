"""Loom's C++ CPU kernels (`loom_shard.kernels`): correct against torch, and batch-invariant."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from loom_shard import kernels
from loom_shard.layers.mlp import GatedMLP
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [576, 583, 5])
def test_add_rms_norm_is_torch_add_then_the_norm_bit_for_bit(dtype: torch.dtype, hidden: int) -> None:
    x, residual = (torch.randn(13, hidden) * 3).to(dtype), torch.randn(13, hidden).to(dtype)
    weight = torch.randn(hidden).to(dtype)
    total, normed = kernels.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(total, x + residual)
    assert torch.equal(normed, kernels.rms_norm(x + residual, weight, 1e-5))
    torch.testing.assert_close(normed.double(), torch.rms_norm((x + residual).double(), (hidden,), weight.double(), 1e-5),
                               atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_add_rms_norm_refuses_a_residual_of_another_shape() -> None:
    with pytest.raises(RuntimeError, match="residual must be"):
        kernels.add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.randn(8), 1e-5)


def test_rms_norm_module_adds_and_normalises_as_its_two_steps() -> None:
    norm = RMSNorm(576, 1e-5).to(torch.bfloat16)
    norm.weight.data.normal_()
    x, residual = torch.randn(4, 576, dtype=torch.bfloat16), torch.randn(4, 576, dtype=torch.bfloat16)
    total, normed = norm.add_forward(x, residual)
    assert torch.equal(total, x + residual) and torch.equal(normed, norm(x + residual))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("intermediate", [1536, 1000, 7])
def test_silu_mul_matches_float64(dtype: torch.dtype, intermediate: int) -> None:
    gate_up = (torch.randn(21, 2 * intermediate) * 4).to(dtype)
    gate, up = gate_up.double().split(intermediate, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    got = kernels.silu_mul(gate_up, intermediate)
    assert got.dtype == dtype and got.shape == (21, intermediate)
    # float32: a few ulp of its exp; bfloat16: one rounding of the float32 result.
    rtol = 2e-6 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(got.double(), expected, atol=1e-6, rtol=rtol)


def test_silu_mul_of_a_row_is_bit_identical_at_any_batch() -> None:
    gate_up = torch.randn(64, 2 * 1000).to(torch.bfloat16)
    alone = torch.cat([kernels.silu_mul(gate_up[i : i + 1], 1000) for i in range(64)])
    for rows in (1, 7, 64):
        assert torch.equal(kernels.silu_mul(gate_up[:rows], 1000), alone[:rows])


def test_silu_mul_of_extremes_is_finite_where_silu_is() -> None:
    gate = torch.tensor([[-200.0, -90.0, -1.0, 0.0, 1.0, 90.0, 200.0]])
    got = kernels.silu_mul(torch.cat([gate, torch.ones_like(gate)], dim=1), 7)
    torch.testing.assert_close(got, torch.nn.functional.silu(gate), atol=1e-30, rtol=1e-6)


def test_silu_mul_keeps_leading_dimensions() -> None:
    gate_up = torch.randn(2, 3, 2 * 40).to(torch.bfloat16)
    assert torch.equal(kernels.silu_mul(gate_up, 40), kernels.silu_mul(gate_up.reshape(6, 80), 40).view(2, 3, 40))


def test_gated_mlp_uses_the_silu_mul_kernel_on_cpu() -> None:
    mlp = GatedMLP(64, 96).to(torch.bfloat16)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    assert torch.equal(mlp(x), mlp.down_proj(kernels.silu_mul(mlp.gate_up_proj(x), 96)))



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


@dataclass
class LoraCase:
    """Tokens of three adapters and the base model (slot -1), factors in the slot layout LoraSlots
    uses ([slots, parts * R, in] and [slots, R, out_p] per part), each slot's rows beyond its
    adapter's rank (slot_ranks) NaN: the kernels must never read them."""

    x: torch.Tensor
    a: torch.Tensor
    b: list[torch.Tensor]
    token_slot: torch.Tensor
    slot_ranks: torch.Tensor

    def shrink(self, rows: slice = slice(None)) -> torch.Tensor:
        return kernels.ops().lora_shrink(self.x[rows], self.a, self.token_slot[rows], self.slot_ranks, len(self.b))

    def expand(self, out: torch.Tensor, h: torch.Tensor, b: list[torch.Tensor] | None = None,
               rows: slice = slice(None)) -> torch.Tensor:
        return kernels.ops().lora_expand_(out, h, b or self.b, self.token_slot[rows], self.slot_ranks)

    def reference(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h and out + deltas in float64, from the factors' rows within each slot's rank."""
        rank = self.b[0].shape[1]
        a, b = self.a.double().nan_to_num(0.0), [part.double().nan_to_num(0.0) for part in self.b]
        h = torch.zeros(len(self.token_slot), a.shape[1], dtype=torch.float64)
        expected = out.double()
        for t, slot in enumerate(self.token_slot.tolist()):
            if slot >= 0:
                h[t] = self.x[t].double() @ a[slot].T
                expected[t] += torch.cat([h[t, p * rank : (p + 1) * rank] @ part[slot] for p, part in enumerate(b)])
        return h, expected


def _lora_case(dtype: torch.dtype, in_features: int, outs: list[int], rank: int = 8) -> LoraCase:
    gen = torch.Generator().manual_seed(in_features)
    token_slot = torch.tensor([2, -1, 0, 2, 3, -1, 0, 0, 2, 3, 3])
    slot_ranks = torch.tensor([rank, 0, 5, 2])
    x = torch.randn(len(token_slot), in_features, generator=gen).to(dtype)
    a = (torch.randn(4, len(outs) * rank, in_features, generator=gen) * 0.2).to(dtype)
    b = [(torch.randn(4, rank, out, generator=gen) * 0.2).to(dtype) for out in outs]
    for slot, used in enumerate(slot_ranks.tolist()):
        for p, part in enumerate(b):
            a[slot, p * rank + used : (p + 1) * rank] = float("nan")
            part[slot, used:] = float("nan")
    return LoraCase(x, a, b, token_slot, slot_ranks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features, outs", [(576, [576, 192, 192]), (72, [40]), (19, [33, 16])])
def test_lora_shrink_and_expand_match_float64(dtype: torch.dtype, in_features: int, outs: list[int]) -> None:
    """Each adapter token gets x @ A[slot].T @ B[slot] added (base tokens nothing), on shapes with and
    without a 16-lane tail, slots of the full rank and of lower ranks."""
    case = _lora_case(dtype, in_features, outs)
    out = torch.randn(len(case.token_slot), sum(outs)).to(dtype)
    expected_h, expected = case.reference(out)
    h = case.shrink()
    torch.testing.assert_close(h.double(), expected_h, atol=1e-5, rtol=1e-5)
    assert case.expand(out, h) is out
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # out rounded to bfloat16 once
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


def test_lora_delta_of_a_token_is_bit_identical_in_any_batch() -> None:
    case = _lora_case(torch.bfloat16, 576, [576, 192, 192])
    base = torch.randn(len(case.token_slot), 960).to(torch.bfloat16)
    batch = case.expand(base.clone(), case.shrink())
    for t in range(len(case.token_slot)):
        row = slice(t, t + 1)
        assert torch.equal(case.expand(base[row].clone(), case.shrink(row), rows=row), batch[row])


def test_lora_kernels_refuse_a_slot_or_rank_out_of_range() -> None:
    case = _lora_case(torch.float32, 72, [40])
    with pytest.raises(RuntimeError, match="slot 4 out of range"):
        kernels.ops().lora_shrink(case.x, case.a, torch.full((len(case.x),), 4), case.slot_ranks, 1)
    with pytest.raises(RuntimeError, match="rank 9 is not in 0..8"):
        kernels.ops().lora_shrink(case.x, case.a, case.token_slot, torch.tensor([9, 0, 0, 0]), 1)


def test_lora_expand_rounds_to_bfloat16_as_torch_does() -> None:
    """A bfloat16 output is the float32 one rounded as torch rounds (nearest, ties to even), in the
    16-lane body and the scalar tail alike; a NaN stays a NaN (c10's 0x7FC0 where torch's vectorized
    conversion writes 0xFFFF)."""
    case = _lora_case(torch.bfloat16, 72, [40, 19])
    shrunk = case.shrink()
    out = (torch.randn(len(case.token_slot), 59) * 100).to(torch.bfloat16).float()  # the same values either way
    out[4, 3] = out[9, 50] = float("nan")
    as_float = case.expand(out.clone(), shrunk, [part.float() for part in case.b])
    as_bf16 = case.expand(out.to(torch.bfloat16), shrunk)
    nan = as_float.isnan()
    assert nan.sum() == 2 and torch.equal(as_bf16.isnan(), nan)
    assert torch.equal(as_bf16[~nan].view(torch.int16), as_float[~nan].to(torch.bfloat16).view(torch.int16))
