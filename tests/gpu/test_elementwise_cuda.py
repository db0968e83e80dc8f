"""The Triton elementwise kernels (`loom_shard.layers.triton_elementwise`) against float64: the
residual add with its RMSNorm, SiLU·mul and rotary (strided q/k views, partial rotary), the
sampler's greedy log-softmax terms against torch's argmax and log_softmax, each row the same at
any batch; and the layers and the sampler choosing them on CUDA."""

from __future__ import annotations

import os

import pytest
import torch

from loom_shard.layers import elementwise
from loom_shard.layers.mlp import gated
from loom_shard.layers.norm import RMSNorm
from loom_shard.layers.rotary import KernelRope, RotaryEmbedding, apply_rotary
from loom_shard.model_config import Activation
from loom_shard.runtime import sampler

triton_elementwise = pytest.importorskip("loom_shard.layers.triton_elementwise", reason="needs triton")
pytestmark = pytest.mark.interpretable
# TRITON_INTERPRET=1 runs these on the CPU too (float32/float16: the interpreter has no bfloat16).
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
LOW = torch.float16 if DEVICE == "cpu" else torch.bfloat16
DTYPES = [(torch.float32, 1e-5), (LOW, 1e-2)]


def _close(actual: torch.Tensor, expected: torch.Tensor, tolerance: float) -> None:
    scale = expected.abs().max().item() or 1.0
    assert (actual.double() - expected).abs().max().item() <= tolerance * scale


@pytest.mark.parametrize(("dtype", "tolerance"), DTYPES)
@pytest.mark.parametrize("hidden", [576, 2048, 5])
def test_add_rms_norm_matches_float64(dtype: torch.dtype, tolerance: float, hidden: int) -> None:
    gen = torch.Generator().manual_seed(hidden)
    x, residual = (torch.randn(7, hidden, generator=gen).to(DEVICE, dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(DEVICE, dtype)
    total, normed = triton_elementwise.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(total, x + residual)  # the residual stream rounds as torch's add
    ref = total.double()
    expected = ref * torch.rsqrt(ref.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
    _close(normed, expected, tolerance)
    _close(triton_elementwise.rms_norm(total, weight, 1e-5), expected, tolerance)


@pytest.mark.parametrize(("dtype", "tolerance"), DTYPES)
@pytest.mark.parametrize("intermediate", [1536, 1000])
def test_silu_mul_matches_float64(dtype: torch.dtype, tolerance: float, intermediate: int) -> None:
    gate_up = torch.randn(2, 3, 2 * intermediate, generator=torch.Generator().manual_seed(0)).to(DEVICE, dtype)
    gate, up = gate_up.double().split(intermediate, dim=-1)
    out = triton_elementwise.silu_mul(gate_up, intermediate)
    assert out.shape == (2, 3, intermediate)
    _close(out, torch.nn.functional.silu(gate) * up, tolerance)


@pytest.mark.parametrize(("dtype", "tolerance"), DTYPES)
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(64, 64), (128, 128), (64, 32)])
def test_rotary_on_a_strided_qk_view_matches_float64(dtype: torch.dtype, tolerance: float, head_dim: int,
                                                     rotary_dim: int) -> None:
    heads, kv_heads, tokens = 9, 3, 11
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=torch.Generator().manual_seed(1))
    qkv = qkv.to(DEVICE, dtype)
    qk = qkv[:, : heads + kv_heads]  # the attention layer's view: q and k heads, strided
    positions = torch.tensor([0, 1, 2, 5, 17, 100, 4095, 3, 3, 64, 9], device=DEVICE)
    rotary = RotaryEmbedding(head_dim, 10000.0, None, rotary_dim=rotary_dim)
    half_cos, half_sin = rotary._half_tables(4096)
    out = triton_elementwise.rotary(qk, positions, half_cos.to(DEVICE), half_sin.to(DEVICE))
    cos = torch.cat([half_cos, half_cos], -1).double()[positions.cpu()].unsqueeze(1)
    signed_sin = torch.cat([-half_sin, half_sin], -1).double()[positions.cpu()].unsqueeze(1)
    x = qk.double().cpu()
    expected = torch.cat([apply_rotary(x[..., :rotary_dim], cos, signed_sin), x[..., rotary_dim:]], -1)
    _close(out.cpu(), expected, tolerance)
    assert torch.equal(out[..., rotary_dim:], qk[..., rotary_dim:])


@pytest.mark.parametrize("vocab", [49152, 5000, 7])
def test_greedy_logprob_terms_match_argmax_and_float64_log_softmax(vocab: int) -> None:
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(vocab)) * 6
    top = logits[1].max() + 1  # a tie (in one lane of two blocks, and in other lanes): the first index wins
    for column in {5, vocab - 1, min(5 + triton_elementwise.TERMS_BLOCK, vocab - 1)}:
        logits[1, column] = top
    logits[2, 3:] = float("-inf")  # masked tokens
    logits[3, -1] = logits[3].max() + 1  # the greatest in the last, partial block
    argmax, row_max, log_sum = triton_elementwise.greedy_logprob_terms(logits.to(DEVICE))
    assert argmax.tolist() == logits.argmax(dim=-1).tolist()
    assert torch.equal(row_max.cpu(), logits.amax(dim=-1))
    logprobs = (logits - row_max.cpu()[:, None]) - log_sum.cpu()[:, None]
    expected = logits.double().log_softmax(-1)
    finite = expected.isfinite()
    assert torch.equal(logprobs.isfinite(), finite)
    assert (logprobs.double() - expected)[finite].abs().max().item() <= 1e-5


def test_greedy_logprob_terms_pick_a_nan_as_torch_does() -> None:
    logits = torch.randn(3, 5000)
    logits[:, 7] = 50.0  # the max comes before each NaN
    logits[0, 40] = logits[1, 4990] = float("nan")  # in the first block, in the last
    argmax, row_max, log_sum = triton_elementwise.greedy_logprob_terms(logits.to(DEVICE))
    assert argmax.tolist() == logits.argmax(dim=-1).tolist() == [40, 4990, 7]
    assert row_max.isnan().tolist() == log_sum.isnan().tolist() == [True, True, False]


@pytest.mark.skipif(DEVICE == "cpu", reason="the sampler chooses the Triton kernel for CUDA tensors only")
def test_sampler_takes_the_triton_terms_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    # float32 logits: the kernels' self-check in float32 runs here, before the patch counts calls
    assert elementwise.kernels_for(torch.empty(1, device=DEVICE)) is triton_elementwise
    terms = triton_elementwise.greedy_logprob_terms
    monkeypatch.setattr(triton_elementwise, "greedy_logprob_terms", lambda x: calls.append(x.shape) or terms(x))
    logits = torch.randn(4, 1000, device=DEVICE)
    got = sampler.logprob_terms(logits)
    assert calls == [(4, 1000)] and torch.equal(got.argmax, logits.argmax(dim=-1))


def test_rows_do_not_depend_on_the_batch() -> None:
    gen = torch.Generator().manual_seed(2)
    x, residual = (torch.randn(64, 576, generator=gen).to(DEVICE, LOW) for _ in range(2))
    weight = torch.randn(576, generator=gen).to(DEVICE, LOW)
    gate_up = torch.randn(64, 3072, generator=gen).to(DEVICE, LOW)
    qk = torch.randn(64, 12, 64, generator=gen).to(DEVICE, LOW)
    logits = (torch.randn(64, 49152, generator=gen) * 6).to(DEVICE)
    positions = torch.randint(0, 4096, (64,), generator=gen).to(DEVICE)
    cos, sin = (t.to(DEVICE) for t in RotaryEmbedding(64, 10000.0, None)._half_tables(4096))
    ops = triton_elementwise
    for rows in (1, 7):
        assert torch.equal(ops.add_rms_norm(x[:rows], residual[:rows], weight, 1e-5)[1],
                           ops.add_rms_norm(x, residual, weight, 1e-5)[1][:rows])
        assert torch.equal(ops.silu_mul(gate_up[:rows], 1536), ops.silu_mul(gate_up, 1536)[:rows])
        assert torch.equal(ops.rotary(qk[:rows], positions[:rows], cos, sin), ops.rotary(qk, positions, cos, sin)[:rows])
        for alone, batch in zip(ops.greedy_logprob_terms(logits[:rows]), ops.greedy_logprob_terms(logits)):
            assert torch.equal(alone, batch[:rows])


@pytest.mark.skipif(DEVICE == "cpu", reason="the layers choose the Triton kernels for CUDA tensors only")
def test_layers_choose_the_triton_kernels_on_cuda() -> None:
    x = torch.randn(3, 64, device=DEVICE, dtype=LOW)
    norm = RMSNorm(64, 1e-6).to(DEVICE, LOW)
    assert elementwise.kernels_for(x) is triton_elementwise
    total, normed = norm.add_forward(x, x)
    torch.testing.assert_close(normed, torch.rms_norm(x + x, (64,), norm.weight, norm.eps), atol=2e-2, rtol=2e-2)
    gate_up = torch.randn(3, 2 * 96, device=DEVICE, dtype=LOW)
    torch.testing.assert_close(gated(gate_up, 96, Activation.SILU),
                               torch.nn.functional.silu(gate_up[:, :96]) * gate_up[:, 96:], atol=2e-2, rtol=2e-2)
    rope = RotaryEmbedding(64, 10000.0, None).lookup(torch.arange(3, device=DEVICE), 2, LOW)
    assert isinstance(rope, KernelRope) and rope.cos.is_cuda


@pytest.mark.parametrize("dtype", [dtype for dtype, _ in DTYPES])
def test_self_check_passes_here(dtype: torch.dtype) -> None:
    triton_elementwise.self_check(torch.device(DEVICE), dtype)


def test_self_check_names_a_kernel_that_computes_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    silu_mul = triton_elementwise.silu_mul
    monkeypatch.setattr(triton_elementwise, "silu_mul", lambda gate_up, n: silu_mul(gate_up, n) * 1.1)
    with pytest.raises(AssertionError, match="silu_mul"):
        triton_elementwise.self_check(torch.device(DEVICE), torch.float32)
