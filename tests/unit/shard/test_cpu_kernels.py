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
    torch.testing.assert_close((logits - row_max[:, None]) - log_sum[:, None], logits.log_softmax(-1), atol=2e-6, rtol=0)


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
