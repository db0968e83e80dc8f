"""A row's result is bit-identical whatever else is in its batch, for the CPU ops this file
owns: the dense linears in every GEMM the probe may choose (oneDNN, oneDNN with single rows run
as two, oneDNN in K chunks, Loom's kernel), bfloat16 and float32, the LM head and its logits, log_softmax, and the sampler.
(Attention and the quantized linears have their own tests.) The probe's decisions are also
checked with oneDNN restricted to older ISAs (ONEDNN_MAX_CPU_ISA), so that this machine makes
the decisions an AVX2 or an AVX-512-without-bf16 machine makes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from loom_proto.step import SamplingParams
from loom_shard import kernels
from loom_shard.layers import row_invariance
from loom_shard.layers.packed_linear import PackedLinear
from loom_shard.layers.row_invariance import Gemm
from loom_shard.runtime.sampler import SeqSamplingState, sample

BATCHES = (1, 7, 64)
SHAPES = [(576, 960), (1536, 576), (2048, 96), (3072, 64)]  # qkv_proj, down_proj (K > 1024), 2 and 3 K chunks
DTYPES = [torch.bfloat16, torch.float32]


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


def _linear(k: int, n: int, dtype: torch.dtype, gemm: Gemm | None) -> PackedLinear:
    torch.manual_seed(k + n)
    return PackedLinear(nn.Linear(k, n, bias=True).to(dtype), gemm=gemm)


def _every_row_as_alone(layer: nn.Module, batch: torch.Tensor) -> bool:
    """Every row of batch[:7] and batch[:64] equals that row computed at batch 1. Every output
    counts: a changed reduction order shows in only a few of them after bfloat16 rounding."""
    with torch.inference_mode():
        alone = torch.cat([layer(batch[i : i + 1]) for i in range(batch.shape[0])])
        return all(torch.equal(layer(batch[:rows]), alone[:rows]) for rows in BATCHES)


def _batch(k: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(64, k, generator=torch.Generator().manual_seed(k)).to(dtype)  # not the probe's inputs


@pytest.mark.parametrize(("k", "n"), SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_chosen_linear_rows_identical_at_batch_1_7_64(k: int, n: int, dtype: torch.dtype) -> None:
    """What the shard runs: the GEMM the probe chose for this shape on this CPU, on other weights and inputs."""
    assert _every_row_as_alone(_linear(k, n, dtype, gemm=None), _batch(k, dtype))


@pytest.mark.parametrize(("k", "n"), SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_chosen_linear_keeps_the_order_of_every_sum(k: int, n: int, dtype: torch.dtype) -> None:
    """Rows built so that any change of the sum's order changes the result, other than the probe's."""
    layer = _linear(k, n, dtype, gemm=None)
    with torch.no_grad():
        layer.weight.fill_(1.0)
    rows = row_invariance.order_revealing_rows(64, k, torch.Generator().manual_seed(k + 7)).to(dtype)
    assert _every_row_as_alone(layer, rows)


@pytest.mark.parametrize(("k", "n"), SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_loom_linear_is_invariant_by_construction(k: int, n: int, dtype: torch.dtype) -> None:
    layer = _linear(k, n, dtype, gemm=Gemm.LOOM)
    assert _every_row_as_alone(layer, _batch(k, dtype))
    x = _batch(k, dtype)[:9]
    with torch.inference_mode():
        reference = F.linear(x.double(), layer.weight.double(), layer.bias.double())
        tolerance = 1e-4 if dtype == torch.float32 else 0.05
        torch.testing.assert_close(layer(x).double(), reference, atol=tolerance, rtol=tolerance / 5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_probe_never_keeps_a_onednn_gemm_that_varies(dtype: torch.dtype) -> None:
    """Where one oneDNN GEMM (or its K chunks) changes a row with the row count here, the probe did not choose it."""
    if not row_invariance.onednn_packs(dtype):
        assert all(row_invariance.choose(k, n, dtype) is Gemm.LOOM for k, n in SHAPES)
        return
    for k, n in SHAPES:
        chosen = row_invariance.choose(k, n, dtype)
        for gemm in (Gemm.ONEDNN, Gemm.ONEDNN_PAIRED, Gemm.ONEDNN_K_CHUNKS):
            if gemm is Gemm.ONEDNN_K_CHUNKS and k <= row_invariance.K_CHUNK:
                continue
            if not _every_row_as_alone(_linear(k, n, dtype, gemm), _batch(k, dtype)):
                assert chosen is not gemm, f"{k}x{n} {dtype}: {gemm.value} varies but the probe chose it"


@pytest.fixture
def without_bf16_dot(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The probe as a CPU without AVX-512 BF16 runs it (its choices are cached per shape)."""
    monkeypatch.setattr(kernels, "bf16_dot", lambda: False)
    row_invariance.choose.cache_clear()
    yield
    row_invariance.choose.cache_clear()


@pytest.mark.parametrize("dtype", DTYPES)
def test_probe_prefers_one_gemm_to_k_chunks(dtype: torch.dtype, without_bf16_dot: None) -> None:
    """Where one oneDNN GEMM keeps rows invariant once a single row runs as two, the probe runs
    each shape as one GEMM (faster than its K chunks, bench/BENCHMARKS.md), not in chunks."""
    if not row_invariance.onednn_packs(dtype):
        pytest.skip(f"oneDNN has no {dtype} path on this CPU")
    for k, n in SHAPES:
        if row_invariance._probe(k, n, dtype, Gemm.ONEDNN_PAIRED):
            assert row_invariance.choose(k, n, dtype) in (Gemm.ONEDNN, Gemm.ONEDNN_PAIRED), (k, n)


@pytest.mark.skipif(not kernels.bf16_dot() or "amx_bf16" in kernels.cpu_flags(),
                    reason="Loom's kernels have no bfloat16 dot products here, or AMX makes oneDNN faster")
@pytest.mark.parametrize(("k", "n"), [*SHAPES, (1101, 33)])
def test_bf16_dot_products_take_every_bfloat16_shape(k: int, n: int) -> None:
    """With AVX-512 BF16 (no AMX) every bfloat16 shape runs Loom's kernel on weights packed in pairs
    of k (an odd K padded): rows as alone at every batch, close to float64."""
    assert row_invariance.choose(k, n, torch.bfloat16) is Gemm.LOOM
    layer = _linear(k, n, torch.bfloat16, gemm=None)
    x = _batch(k, torch.bfloat16)
    assert _every_row_as_alone(layer, x)
    assert layer._packed is not None and layer._packed[0].shape == (-(-n // 16), -(-k // 2), 16, 2)
    with torch.inference_mode():
        reference = F.linear(x.double(), layer.weight.double(), layer.bias.double())
        torch.testing.assert_close(layer(x).double(), reference, atol=0.05, rtol=0.01)


@pytest.mark.parametrize(("k", "n"), SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_rows_identical_across_chunkings(k: int, n: int, dtype: torch.dtype) -> None:
    """A prompt of 40 tokens computed in one step or in chunks of 16, 1 and 23: the same rows."""
    layer = _linear(k, n, dtype, gemm=None)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(k)).to(dtype)
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
        assert sum(chunks) == k and max(chunks) <= row_invariance.K_CHUNK


@pytest.mark.skipif(not row_invariance.onednn_packs(torch.bfloat16), reason="oneDNN has no bfloat16 path on this CPU")
def test_every_gemm_agrees_with_the_float_reference() -> None:
    """The K-chunked sum rounds once more than one GEMM: close, never a different computation."""
    x = torch.randn(9, 1536).to(torch.bfloat16)
    layers = [_linear(1536, 576, torch.bfloat16, gemm) for gemm in (Gemm.ONEDNN, Gemm.ONEDNN_K_CHUNKS, Gemm.LOOM)]
    with torch.inference_mode():
        reference = F.linear(x.float(), layers[0].weight.float(), layers[0].bias.float())
        assert len(layers[1].packed_weights(Gemm.ONEDNN_K_CHUNKS)) == 2
        for layer in layers:
            out = layer(x)
            assert out.dtype == torch.bfloat16
            torch.testing.assert_close(out.float(), reference, atol=0.05, rtol=0.02)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lm_head_logits_and_log_softmax_rows_identical(dtype: torch.dtype) -> None:
    """compute_logits' path: the head (K = 576, N = 49152) in the model's dtype, then float32 log_softmax."""
    head = _linear(576, 49152, dtype, gemm=None)
    hidden = torch.randn(64, 576).to(dtype)
    with torch.inference_mode():
        assert _all_equal(_rows_of(lambda x: head(x).float().log_softmax(-1), hidden))


_RESTRICTED_PROBE = textwrap.dedent("""
    import torch
    from torch import nn
    from loom_shard.layers import row_invariance
    from loom_shard.layers.packed_linear import PackedLinear
    from loom_shard.layers.row_invariance import Gemm
    from loom_shard import kernels
    from loom_shard.runtime.model_setup import choose_dtype
    kernels.bf16_dot = lambda: False  # the CPUs these stand for have no AVX-512 BF16
    expect_bf16 = {expect_bf16}
    assert row_invariance.onednn_packs(torch.bfloat16) is expect_bf16
    dtype, why = choose_dtype(None, torch.device("cpu"))
    print("default dtype", dtype, why)
    assert dtype == torch.bfloat16  # natively, or through Loom's kernels
    for dtype in (torch.bfloat16, torch.float32):
        for k, n in {shapes}:
            gemm = row_invariance.choose(k, n, dtype)
            print(dtype, k, n, gemm.value)
            if dtype == torch.bfloat16 and not expect_bf16:
                assert gemm is Gemm.LOOM
            torch.manual_seed(k)
            layer = PackedLinear(nn.Linear(k, n).to(dtype))
            x = torch.randn(64, k, generator=torch.Generator().manual_seed(n)).to(dtype)
            with torch.inference_mode():
                alone = torch.cat([layer(x[i : i + 1]) for i in range(64)])
                assert all(torch.equal(layer(x[:r]), alone[:r]) for r in (7, 64)), (dtype, k, n, gemm)
""")


@pytest.mark.parametrize(("isa", "expect_bf16"), [("AVX2", False), ("AVX512_CORE", True)])
def test_probe_decides_right_under_an_older_onednn_isa(isa: str, expect_bf16: bool) -> None:
    """oneDNN restricted to AVX2 (an AVX2-only EPYC: no bfloat16 path, so Loom's kernel runs its
    bfloat16 linears) or to AVX-512 without bf16 instructions: every chosen linear still keeps rows
    invariant, in bfloat16 and float32."""
    if isa == "AVX512_CORE" and "avx512bw" not in kernels.cpu_flags():
        pytest.skip("this CPU has no AVX-512")
    script = _RESTRICTED_PROBE.format(expect_bf16=expect_bf16, shapes=SHAPES[:2])
    result = subprocess.run([sys.executable, "-c", script], env={**os.environ, "ONEDNN_MAX_CPU_ISA": isa},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


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
