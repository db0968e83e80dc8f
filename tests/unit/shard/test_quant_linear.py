"""QuantLinear and loom::qlinear against the dequantized float reference.

Weights are real GGUF blocks made by gguf-py's quantizer from random floats (Q8_16: Q6_K blocks,
Q8_M: Q5_1 blocks, converted as at load); the reference is their dequantization multiplied in float64.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from loom_shard.layers.quant_linear import (
    BLOCK,
    QuantKind,
    QuantLinear,
    QuantSource,
    convert_rows,
    iq4_nl_as_q8_0,
    iq4_xs_as_q8_0,
    q3_k_as_q8_16,
    q4_0_as_q4_1,
    q4_k_as_q4_1,
    q5_0_as_q8_0,
    q5_1_as_q8_m,
    q5_k_as_q8_m,
    q6_k_as_q8_16,
    raw_source,
)
from tests.unit.shard.k_quants import SUPER, quantize_q3_k, quantize_q4_k, quantize_q5_k, quantize_q6_k

needs_kernels = pytest.mark.usefixtures("kernel_isa")  # once per build this CPU runs
KINDS = list(QuantKind)


def make_source(kind: QuantKind, out_features: int, in_features: int, seed: int = 0) -> tuple[QuantSource, torch.Tensor]:
    """Random weights quantized by gguf-py; returns the blocks and their float64 dequantization."""
    rng = np.random.default_rng(seed)
    weights = (rng.standard_normal((out_features, in_features)) * 0.05 + 0.01).astype(np.float32)
    if kind is QuantKind.Q8_16:  # Q6_K super-blocks of 256 as converted at load, cut to in_features
        padded = np.pad(weights, ((0, 0), (0, -in_features % SUPER)))
        raw = q6_k_as_q8_16(quantize_q6_k(padded))[:, : in_features // BLOCK * kind.block_bytes]
        source = raw_source(kind, raw, in_features)
        return source, source.dequantize().double()
    if kind is QuantKind.Q8_M:  # Q5_1 blocks as converted at load: the same weights
        raw = quantize(weights, GGMLQuantizationType.Q5_1)
        reference = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q5_1).astype(np.float64))
        return raw_source(kind, q5_1_as_q8_m(raw), in_features), reference
    raw = quantize(weights, GGMLQuantizationType[kind.name])
    reference = torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind.name]).astype(np.float64))
    return raw_source(kind, raw, in_features), reference


def reference_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.double() @ weight.T
    return y if bias is None else y + bias.double()


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """What loom::qlinear multiplies: x per row and block of 32 as int8 (llama.cpp's Q8_0: d = amax / 127,
    q = round-half-even(x / d), both in float32), returned dequantized in float64."""
    blocks = x.float().reshape(*x.shape[:-1], -1, BLOCK)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.round(blocks * inverse)
    return (q.double() * d.double()).reshape(x.shape)


@pytest.mark.parametrize("kind", [QuantKind.Q4_1, QuantKind.Q8_0])
def test_source_dequantizes_like_gguf_py(kind: QuantKind) -> None:
    source, reference = make_source(kind, 48, 96)
    assert torch.equal(source.dequantize().double(), reference)


def test_q4_0_runs_as_q4_1_with_the_same_weights() -> None:
    # Q4_0's d is often negative (gguf-py's quantizer divides the signed largest value by -8), and
    # some blocks are all zeros (d = 0): both convert to m = -8 d exactly.
    rng = np.random.default_rng(3)
    weights = (rng.standard_normal((40, 128)) * 0.05).astype(np.float32)
    weights[3, 32:64] = 0
    weights[4] *= 1e3
    raw = quantize(weights, GGMLQuantizationType.Q4_0)
    reference = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_0))
    converted = q4_0_as_q4_1(raw)
    assert converted.shape == (40, 128 // BLOCK * QuantKind.Q4_1.block_bytes)
    source = raw_source(QuantKind.Q4_1, converted, 128)
    assert torch.equal(source.dequantize(), reference)  # bit for bit
    assert torch.equal(source.dequantize(), torch.from_numpy(dequantize(converted, GGMLQuantizationType.Q4_1)))
    raw[7, 0:2] = np.array([9000.0], dtype=np.float16).view(np.uint8)  # -8 d would overflow fp16
    assert q4_0_as_q4_1(raw) is None  # that weight is dequantized instead


@pytest.mark.parametrize(("file_kind", "kind", "convert"),
                         [("Q5_0", QuantKind.Q8_0, q5_0_as_q8_0), ("Q5_1", QuantKind.Q8_M, q5_1_as_q8_m)])
def test_five_bit_formats_run_as_int8_with_the_same_weights(file_kind: str, kind: QuantKind,
                                                           convert: Callable[[np.ndarray], np.ndarray]) -> None:
    rng = np.random.default_rng(5)
    weights = (rng.standard_normal((24, 96)) * 0.05 + 0.02).astype(np.float32)
    weights[2, :32] = 0
    raw = quantize(weights, GGMLQuantizationType[file_kind])
    converted = convert(raw)
    assert converted.shape == (24, 96 // BLOCK * kind.block_bytes)
    source = raw_source(kind, converted, 96)
    assert torch.equal(source.dequantize(), torch.from_numpy(dequantize(raw, GGMLQuantizationType[file_kind])))  # bit for bit


def test_a_tensor_converts_a_chunk_of_rows_at_a_time_as_whole() -> None:
    raw = quantize_q6_k((np.random.default_rng(10).standard_normal((37, 512)) * 0.05).astype(np.float32))
    chunk = 5 * raw.shape[1]  # 8 chunks of 5 rows
    assert np.array_equal(convert_rows(q6_k_as_q8_16, raw, chunk_bytes=chunk), q6_k_as_q8_16(raw))
    raw[36, 208:210] = np.array([60000.0], dtype=np.float16).view(np.uint8)  # d sc overflows fp16 in the last chunk
    assert convert_rows(q6_k_as_q8_16, raw, chunk_bytes=chunk) is None


def test_iq4_formats_run_as_q8_0_with_their_table_values() -> None:
    # Any bytes make valid IQ4 blocks: random indices and scales, d set.
    rng = np.random.default_rng(9)
    nl = rng.integers(0, 256, (8, 16, 18), dtype=np.uint8)
    nl[..., 0:2] = np.array([0.01], dtype=np.float16).view(np.uint8)
    nl = nl.reshape(8, -1)
    source = raw_source(QuantKind.Q8_0, iq4_nl_as_q8_0(nl), 512)
    assert torch.equal(source.dequantize(), torch.from_numpy(dequantize(nl, GGMLQuantizationType.IQ4_NL)))  # bit for bit
    xs = rng.integers(0, 256, (8, 2, 136), dtype=np.uint8)
    xs[..., 0:2] = np.array([0.003], dtype=np.float16).view(np.uint8)
    xs[3, 1, 0:2] = 0  # a zero super-block
    xs = xs.reshape(8, -1)
    source = raw_source(QuantKind.Q8_0, iq4_xs_as_q8_0(xs), 512)
    q, d, _ = source.blocks()
    bound = 2.0**-11 * (d.abs()[..., None] * q.abs().reshape(8, -1, BLOCK)).reshape(8, 512)
    error = (source.dequantize() - torch.from_numpy(dequantize(xs, GGMLQuantizationType.IQ4_XS))).abs()
    assert (error <= bound * 1.01).all() and error.max() > 0  # the table values; scales within fp16's rounding
    assert torch.equal(source.dequantize()[3, 256:], torch.zeros(256))
    xs[5, 0:2] = np.array([60000.0], dtype=np.float16).view(np.uint8)  # d (ls - 32) overflows fp16
    assert iq4_xs_as_q8_0(xs) is None


@pytest.mark.parametrize(("write", "file_kind", "kind", "convert"),
                         [(quantize_q4_k, "Q4_K", QuantKind.Q4_1, q4_k_as_q4_1),
                          (quantize_q5_k, "Q5_K", QuantKind.Q8_M, q5_k_as_q8_m)])
def test_k_quants_keep_their_integers_with_block_scales_rounded_to_fp16(
        write: Callable[[np.ndarray], np.ndarray], file_kind: str, kind: QuantKind,
        convert: Callable[[np.ndarray], np.ndarray | None]) -> None:
    rng = np.random.default_rng(6)
    weights = (rng.standard_normal((12, 512)) * 0.05 + 0.01).astype(np.float32)
    weights[2, 256:] = 0  # a zero super-block: d = dmin = 0
    weights[5] *= 300  # scales far from the others' exponents
    raw = write(weights)
    reference = dequantize(raw, GGMLQuantizationType[file_kind])
    converted = convert(raw)
    assert converted.shape == (12, 512 // BLOCK * kind.block_bytes)
    source = raw_source(kind, converted, 512)
    q, d, m = source.blocks()
    # The file's integers; each block's scale and min within fp16's rounding of their exact value.
    bound = 2.0**-11 * (d.abs()[..., None] * q.reshape(12, -1, BLOCK) + m.abs()[..., None]).reshape(12, 512)
    error = (source.dequantize() - torch.from_numpy(reference)).abs()
    assert (error <= bound * 1.01).all() and error.max() > 0
    assert torch.equal(source.dequantize()[2, 256:], torch.zeros(256))
    raw[7, 0:2] = np.array([60000.0], dtype=np.float16).view(np.uint8)  # d sc overflows fp16
    assert convert(raw) is None  # that weight is dequantized instead


# Q6_K: 192 bytes of integers, int8 scales (xor 0x80: negative), d at 208. Q3_K: 96 bytes of
# integers, the scales' high bit pairs at 104..107 (xor 0xAA: sc - 32 negative), d at 108.
@pytest.mark.parametrize(("write", "file_kind", "convert", "integers", "flip_scales", "d_at"),
                         [(quantize_q6_k, "Q6_K", q6_k_as_q8_16, 192, (slice(192, 208), 0x80), 208),
                          (quantize_q3_k, "Q3_K", q3_k_as_q8_16, 96, (slice(104, 108), 0xAA), 108)])
def test_k_quants_with_a_scale_per_16_run_as_q8_16_with_its_scales_rounded_to_fp16(
        write: Callable[[np.ndarray], np.ndarray], file_kind: str, convert: Callable[[np.ndarray], np.ndarray | None],
        integers: int, flip_scales: tuple[slice, int], d_at: int) -> None:
    rng = np.random.default_rng(7)
    weights = (rng.standard_normal((12, 512)) * 0.05).astype(np.float32)
    weights[2, 256:] = 0  # a zero super-block: d = 0
    weights[5] *= 300  # scales far from the others' exponents
    raw = write(weights)
    raw[4, flip_scales[0]] ^= flip_scales[1]  # negative sub-block scales
    raw[4, :integers] ^= 0x5A  # and other integers
    reference = dequantize(raw, GGMLQuantizationType[file_kind])
    converted = convert(raw)
    assert converted.shape == (12, 512 // BLOCK * QuantKind.Q8_16.block_bytes)
    source = raw_source(QuantKind.Q8_16, converted, 512)
    q, d, _ = source.blocks()
    # The file's integers; each 16's scale within fp16's rounding of its exact value.
    bound = 2.0**-11 * (d.abs()[..., None] * q.abs().reshape(12, -1, 16)).reshape(12, 512)
    error = (source.dequantize() - torch.from_numpy(reference)).abs()
    assert (error <= bound * 1.01).all() and error.max() > 0
    assert torch.equal(source.dequantize()[2, 256:], torch.zeros(256))
    assert (d[4] < 0).any()
    raw[7, d_at : d_at + 2] = np.array([60000.0], dtype=np.float16).view(np.uint8)  # d sc overflows fp16
    assert convert(raw) is None  # that weight is dequantized instead


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_matches_the_dequantized_reference(kind: QuantKind, dtype: torch.dtype) -> None:
    source, weight = make_source(kind, 200, 160)  # 200 columns: a partial last tile of 16
    x = torch.randn(37, 160, generator=torch.Generator().manual_seed(1)).to(dtype)
    x[5, 32:64] = 0  # a block of zeros: d = 0
    x[6] *= 1e3  # large values: only the scales change
    y = QuantLinear(source, None, dtype)(x)
    expected = reference_matmul(quantize_activations(x), weight)
    assert y.dtype == dtype and y.shape == (37, 200)
    # The int dots are exact: what is left is the float32 folding per block and, for bf16, the
    # output's own rounding (2^-8 relative).
    tolerance = 2**-8 if dtype == torch.bfloat16 else 1e-5
    assert (y.double() - expected).abs().max() <= tolerance * expected.abs().max()
    # int8 activations cost accuracy against the unquantized x: about 1% here (measured 0.7%).
    unquantized = reference_matmul(x, weight)
    assert (y.double() - unquantized).abs().max() <= 0.02 * unquantized.abs().max()


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_row_is_bit_identical_at_any_batch_size(kind: QuantKind, dtype: torch.dtype) -> None:
    # 208 columns: 13 tiles of 16, so the last register tile has one column tile; 70 rows: row tiles
    # of 4 with a tail, and two row chunks of 64.
    source, _ = make_source(kind, 208, 128)
    layer = QuantLinear(source, None, dtype)
    x = torch.randn(70, 128, generator=torch.Generator().manual_seed(2)).to(dtype)
    x[3, :32] = 0  # a block of zeros: d = 0
    full = layer(x)
    for batch in (1, 2, 3, 7, 64, 70):
        for start in (0, 5, 70 - batch):
            assert torch.equal(layer(x[start : start + batch]), full[start : start + batch]), (batch, start)


@needs_kernels
@pytest.mark.parametrize("kind", [QuantKind.Q8_0, QuantKind.Q8_16])
def test_int8_extremes_stay_exact(kind: QuantKind) -> None:
    """Weights of -128 and 127 against activations that quantize to +-127 (q + 128 = 1 or 255):
    the largest products and sums the int8 paths meet (int16 partial sums on AVX2). Every
    scale is 1, so each output is the integer dot itself, exact in float32."""
    out_features, in_features = 48, 96
    rng = np.random.default_rng(4)
    q = rng.choice(np.array([-128, 127, -127, 1], dtype=np.int8), size=(out_features, in_features))
    q[:16] = -128  # whole columns at the extremes: every partial sum at its largest
    q[16:32] = 127
    head = 2 * kind.scales
    blocks = np.zeros((out_features, in_features // BLOCK, head + BLOCK), dtype=np.uint8)
    blocks[..., :head] = np.frombuffer(np.float16(1.0).tobytes() * kind.scales, dtype=np.uint8)
    blocks[..., head:] = q.reshape(out_features, -1, BLOCK).view(np.uint8)
    layer = QuantLinear(raw_source(kind, blocks.reshape(out_features, -1), in_features), None, torch.float32)
    signs = torch.from_numpy(rng.choice([-1.0, 1.0], size=(5, in_features)).astype(np.float32))
    signs[0], signs[1] = 1.0, -1.0  # rows of one sign: q = 127 (255 after + 128) or -127 (1)
    x = signs * 127.0  # d = 1: every activation quantizes to +-127 exactly
    expected = (signs.double() * 127) @ torch.from_numpy(q.astype(np.float64)).T
    assert torch.equal(layer(x).double(), expected)


@needs_kernels
def test_kernel_adds_the_bias_and_keeps_leading_dims() -> None:
    source, weight = make_source(QuantKind.Q4_1, 64, 64)
    bias = torch.randn(64)
    x = torch.randn(2, 3, 64)
    y = QuantLinear(source, bias, torch.float32)(x)
    assert y.shape == (2, 3, 64)
    expected = reference_matmul(quantize_activations(x.reshape(6, 64)), weight, bias).reshape(2, 3, 64)
    assert (y.double() - expected).abs().max() <= 1e-5 * expected.abs().max()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_torch_fallback_matches_the_reference(kind: QuantKind, dtype: torch.dtype) -> None:
    # Without the kernels: torch's int4pack for Q4_1, a dequantized matmul for Q8_0 and Q8_16.
    source, weight = make_source(kind, 96, 128)
    bias = torch.randn(96)
    layer = QuantLinear(source, bias, dtype, use_kernels=False)
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(3)).to(dtype)
    y = layer(x)
    expected = reference_matmul(x, weight, bias)
    tolerance = 2**-7 if dtype == torch.bfloat16 else 1e-5
    assert (y.double() - expected).abs().max() <= tolerance * expected.abs().max()


def test_module_to_dtype_leaves_the_quantized_buffers_alone() -> None:
    source, _ = make_source(QuantKind.Q4_1, 32, 64)
    layer = QuantLinear(source, torch.zeros(32), torch.float32)
    before = {name: b.clone() for name, b in layer.named_buffers()}
    layer.to(torch.bfloat16)
    assert all(torch.equal(before[name], b) for name, b in layer.named_buffers())
    assert layer.bias.dtype == torch.bfloat16
    assert set(layer.state_dict()) == {"bias"}  # packed weights are rebuilt from the GGUF, not saved


def test_fusing_needs_one_kind_and_width() -> None:
    q4, _ = make_source(QuantKind.Q4_1, 32, 64)
    q8, _ = make_source(QuantKind.Q8_0, 32, 64)
    assert QuantSource.cat([q4, q4]).out_features == 64
    with pytest.raises(ValueError):
        QuantSource.cat([q4, q8])


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
def test_a_row_is_bit_identical_at_any_thread_count(kind: QuantKind) -> None:
    # Threads split the output columns only, never a row's reduction or its activation quantization:
    # in fixed ranges (9 rows, decode) or in runs handed out as threads ask (70 rows, prefill).
    source, _ = make_source(kind, 208, 128)
    layer = QuantLinear(source, None, torch.bfloat16)
    x = torch.randn(70, 128, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [layer(x[:9]), layer(x)]
        torch.set_num_threads(2)
        two = [layer(x[:9]), layer(x)]
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(one, two))
