"""Issue 14: a row's result is bit-identical whatever else is in its batch, for the CPU ops this
branch owns: the bfloat16 linears (one GEMM and K-chunked), the LM head and its logits,
log_softmax, and the sampler. (Attention and the quantized linears have their own tests.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from loom_proto.step import SamplingParams
from loom_shard.layers import row_invariance
from loom_shard.layers.packed_linear import PackedLinear
from loom_shard.sampler import SeqSamplingState, sample

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")

BATCHES = (1, 7, 64)
SHAPES = [(576, 960), (1536, 576), (2048, 96), (3072, 64)]  # qkv_proj, down_proj (K > 1024), 2 and 3 K chunks


def _rows_of(op, batch: torch.Tensor) -> list[torch.Tensor]:  # noqa: ANN001 - any row-wise op
    """Row 0 of batch computed at each of BATCHES rows, the row placed first, in the middle and last."""
    results = []
    for rows in BATCHES:
        for where in {0, rows // 2, rows - 1}:
            others = batch[1:rows]
            x = torch.cat([others[:where], batch[:1], others[where:]])
            results.append(op(x)[where])
    return results


def _all_equal(results: list[torch.Tensor]) -> bool:
    return all(torch.equal(r, results[0]) for r in results)


def _linear(k: int, n: int, split_k: bool | None) -> PackedLinear:
    torch.manual_seed(k + n)
    linear = nn.Linear(k, n, bias=True).to(torch.bfloat16)
    return PackedLinear(linear, split_k=split_k)


def _every_row_as_alone(layer: nn.Module, batch: torch.Tensor) -> bool:
    """Every row of batch[:7] and batch[:64] equals that row computed at batch 1. Every output
    counts: a changed reduction order shows in only a few of them after bfloat16 rounding."""
    with torch.inference_mode():
        alone = torch.cat([layer(batch[i : i + 1]) for i in range(batch.shape[0])])
        return all(torch.equal(layer(batch[:rows]), alone[:rows]) for rows in BATCHES)


@pytest.mark.parametrize(("k", "n"), SHAPES)
@pytest.mark.parametrize("split_k", [None, False, True])
def test_bfloat16_linear_rows_identical_at_batch_1_7_64(k: int, n: int, split_k: bool | None) -> None:
    layer = _linear(k, n, split_k)
    if split_k is False and row_invariance.onednn_needs_split(k, n):
        pytest.skip(f"oneDNN's one-GEMM {k}x{n} is not row-invariant on this CPU: the default splits it")
    gen = torch.Generator().manual_seed(k)
    assert _every_row_as_alone(layer, torch.randn(64, k, generator=gen).to(torch.bfloat16))


def test_probe_agrees_with_the_one_gemm() -> None:
    """The probe says 'split' exactly when the one-GEMM layer changes some row with the row count."""
    for k, n in SHAPES:
        gen = torch.Generator().manual_seed(k + 1)
        varies = not _every_row_as_alone(_linear(k, n, split_k=False), torch.randn(64, k, generator=gen).to(torch.bfloat16))
        if varies:
            assert row_invariance.onednn_needs_split(k, n), f"{k}x{n} varies but the probe keeps one GEMM"


@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_bfloat16_linear_rows_identical_across_chunkings(k: int, n: int) -> None:
    """A prompt of 40 tokens computed in one step or in chunks of 16, 1 and 23: the same rows."""
    layer = _linear(k, n, split_k=None)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
    with torch.inference_mode():
        whole = layer(x)
        chunked = torch.cat([layer(x[:16]), layer(x[16:17]), layer(x[17:])])
    assert torch.equal(chunked, whole)


def test_k_chunks_cover_k_in_at_most_max_k() -> None:
    assert row_invariance.k_chunks(1536) == [768, 768]
    assert row_invariance.k_chunks(1024) == [1024]
    assert row_invariance.k_chunks(2049) == [683, 683, 683]
    for k in (1, 576, 1025, 4096, 11008):
        chunks = row_invariance.k_chunks(k)
        assert sum(chunks) == k and max(chunks) <= row_invariance.MAX_INVARIANT_K


def test_split_k_linear_agrees_with_one_gemm() -> None:
    """The chunked sum rounds once more than one GEMM: close, never a different computation."""
    one, split = _linear(1536, 576, split_k=False), _linear(1536, 576, split_k=True)
    x = torch.randn(9, 1536).to(torch.bfloat16)
    with torch.inference_mode():
        reference = F.linear(x.float(), one.weight.float(), one.bias.float())
        assert len(split._packed_weight()) == 2
        for out in (one(x), split(x)):
            assert out.dtype == torch.bfloat16
            torch.testing.assert_close(out.float(), reference, atol=0.05, rtol=0.02)


def test_lm_head_logits_and_log_softmax_rows_identical() -> None:
    """compute_logits' path: bfloat16 head (K = 576, N = 49152) then float32 log_softmax."""
    head = _linear(576, 49152, split_k=None)
    hidden = torch.randn(64, 576).to(torch.bfloat16)
    with torch.inference_mode():
        assert _all_equal(_rows_of(lambda x: head(x).float().log_softmax(-1), hidden))


def _mixed_states(count: int, seed: int) -> list[SeqSamplingState]:
    """Rows asking for every kind of processing and filter, seeded differently."""
    kinds = [
        SamplingParams(seed=seed),
        SamplingParams(seed=seed, do_sample=True, temperature=0.7, top_p=0.9),
        SamplingParams(seed=seed, do_sample=True, top_k=40, min_p=0.05, top_n_tokens=3),
        SamplingParams(seed=seed, do_sample=True, typical_p=0.8, repetition_penalty=1.3),
        SamplingParams(seed=seed, do_sample=True, temperature=1.3, frequency_penalty=0.5, logit_bias={5: 3.0}),
    ]
    return [SeqSamplingState(kinds[(i + seed) % len(kinds)], [1, 2, 3, 9, 9, 4], 3) for i in range(count)]


@pytest.mark.parametrize("kind", range(5))
def test_sampler_rows_identical_at_batch_1_7_64(kind: int) -> None:
    """A seeded row's token, logprob and alternatives depend only on its logits, seed and position."""
    torch.manual_seed(kind)
    logits = torch.randn(64, 49152) * 4
    target = _mixed_states(5, seed=11)[kind]
    others = _mixed_states(64, seed=3)
    results = []
    for rows in BATCHES:
        for where in {0, rows // 2, rows - 1}:
            states = others[: rows - 1]
            states = states[:where] + [target] + states[where:]
            batch = torch.cat([logits[1:rows][:where], logits[:1], logits[1:rows][where:]])
            s = sample(batch, states)[where]
            results.append((s.token_id, s.logprob, [(t.token_id, t.logprob) for t in s.top_tokens]))
    assert all(r == results[0] for r in results)
