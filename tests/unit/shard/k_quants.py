"""GGUF Q3_K, Q4_K, Q5_K, Q6_K and IQ4_NL blocks for tests: gguf-py dequantizes them but does not make them.

Plain min/max quantizers in llama.cpp's block layouts (not its error-minimizing search): every
block they write is a valid block of its format, which is all a loader test needs; gguf-py's
dequantization stays the reference.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import IQ4_NL

SUPER = 256  # weights per K-quant super-block


def quantize_q4_k(weights: np.ndarray) -> np.ndarray:
    """float32 [rows, columns] (columns a multiple of 256) -> Q4_K raw blocks [rows, columns / 256 * 144]."""
    header, q = _scales_and_mins(weights, 15)
    q = q.reshape(-1, 4, 2, 32)
    nibbles = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)  # chunk j: block 2j low, 2j + 1 high
    return np.concatenate([header, nibbles], axis=1).reshape(weights.shape[0], -1)


def quantize_q5_k(weights: np.ndarray) -> np.ndarray:
    """float32 [rows, columns] (columns a multiple of 256) -> Q5_K raw blocks [rows, columns / 256 * 176]:
    Q4_K's header, 32 bytes of fifth bits (byte i's bit j: block j's q_i), Q4_K's nibbles."""
    header, q = _scales_and_mins(weights, 31)
    q = q.reshape(-1, 8, 32)
    fifth = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for j in range(8):
        fifth |= (q[:, j] >> 4) << j
    low = (q & 0x0F).reshape(-1, 4, 2, 32)
    nibbles = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([header, fifth, nibbles], axis=1).reshape(weights.shape[0], -1)


def _scales_and_mins(weights: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's 16-byte header per super-block (fp16 d, dmin, 6-bit scales and mins) and
    each weight's q in 0..top (uint8 [super-blocks, 256]): w = d sc q - dmin mn."""
    x = weights.astype(np.float32).reshape(-1, 8, 32)
    offset = np.maximum(-x.min(axis=-1), 0)  # mn >= 0
    scale = (x.max(axis=-1) + offset) / top
    d = (scale.max(axis=-1) / 63).astype(np.float16)
    dmin = (offset.max(axis=-1) / 63).astype(np.float16)
    sc = _six_bits(scale, d)
    mn = _six_bits(offset, dmin)
    block_scale = d.astype(np.float32)[:, None] * sc
    block_min = dmin.astype(np.float32)[:, None] * mn
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(block_scale[..., None] > 0, np.rint((x + block_min[..., None]) / block_scale[..., None]), 0)
    q = np.clip(q, 0, top).astype(np.uint8).reshape(-1, SUPER)
    header = np.concatenate([d[:, None].view(np.uint8), dmin[:, None].view(np.uint8), _pack_scales(sc, mn)], axis=1)
    return header, q


def _six_bits(values: np.ndarray, step: np.ndarray) -> np.ndarray:
    step32 = step.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(step32 > 0, np.clip(np.rint(values / step32), 0, 63), 0).astype(np.uint8)


def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """llama.cpp's 12 bytes of eight 6-bit scales and mins (gguf.quants.Q4_K.get_scale_min reads them)."""
    low = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), mn[:, :4] | ((mn[:, 4:] >> 4) << 6)], axis=1)
    return np.concatenate([low, (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)], axis=1).astype(np.uint8)


def quantize_q6_k(weights: np.ndarray) -> np.ndarray:
    """float32 [rows, columns] (columns a multiple of 256) -> Q6_K raw blocks [rows, columns / 256 * 210]:
    128 bytes of low nibbles, 64 of high bit pairs, int8 sc per 16, fp16 d; w = d sc (q - 32)."""
    rows, columns = weights.shape
    d, sc, q = _scaled_per_16(weights, (-32, 31), (-128, 127))
    q = (q + 32).astype(np.uint8).reshape(-1, SUPER)
    low, high = q & 0x0F, q >> 4
    low = low.reshape(-1, 2, 2, 64)  # half h: byte i holds element 128h + i low, 128h + 64 + i high
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    high = high.reshape(-1, 2, 4, 32)  # half h: byte i's bit pair s holds element 128h + 32s + i
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(-1, 64)
    packed = np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), d[:, None].view(np.uint8)], axis=1)
    return packed.reshape(rows, columns // SUPER * 210)


def quantize_q3_k(weights: np.ndarray) -> np.ndarray:
    """float32 [rows, columns] (columns a multiple of 256) -> Q3_K raw blocks [rows, columns / 256 * 110]:
    32 bytes of high bits, 64 of 2-bit pairs, 12 of 6-bit scales, fp16 d; w = d (sc - 32) q, q in -4..3."""
    rows, columns = weights.shape
    d, sc, q = _scaled_per_16(weights, (-4, 3), (-32, 31))
    sc6 = (sc + 32).astype(np.uint8)  # [super-blocks, 16]
    low = sc6[:, :8] & 0x0F | ((sc6[:, 8:] & 0x0F) << 4)  # byte i: scale i low, scale 8 + i high nibble
    high = sc6 >> 4  # 2 bits each: byte 8 + i holds scales i, 4 + i, 8 + i, 12 + i
    high = high[:, 0:4] | (high[:, 4:8] << 2) | (high[:, 8:12] << 4) | (high[:, 12:16] << 6)
    u = (q + 4).astype(np.uint8).reshape(-1, SUPER)  # 4 high + 2-bit low
    pairs = (u & 3).reshape(-1, 2, 4, 32)  # half h: byte i's pair s holds weight 128h + 32s + i
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 2) | (pairs[:, :, 2] << 4) | (pairs[:, :, 3] << 6)).reshape(-1, 64)
    bits = (u >> 2).reshape(-1, 8, 32)  # byte i's bit j: weight 32j + i
    hmask = np.zeros((u.shape[0], 32), dtype=np.uint8)
    for j in range(8):
        hmask |= bits[:, j] << j
    packed = np.concatenate([hmask, qs, low, high, d[:, None].view(np.uint8)], axis=1)
    return packed.reshape(rows, columns // SUPER * 110)


def _scaled_per_16(weights: np.ndarray, q_range: tuple[int, int],
                   sc_range: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Symmetric K-quant integers, w = d sc q with a scale sc per 16 weights and fp16 d per 256:
    (d [super-blocks], sc [super-blocks, 16], q [super-blocks, 16, 16]) as floats holding integers."""
    x = weights.astype(np.float32).reshape(-1, 16, 16)
    scale = np.abs(x).max(axis=-1) / -q_range[0]
    d = (scale.max(axis=-1) / sc_range[1]).astype(np.float16)
    d32 = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32 > 0, np.clip(np.rint(scale / d32), *sc_range), 0)
        step = (d32 * sc)[..., None]
        q = np.where(step > 0, np.clip(np.rint(x / step), *q_range), 0)
    return d, sc, q


def quantize_iq4_nl(weights: np.ndarray) -> np.ndarray:
    """float32 [rows, columns] (columns a multiple of 32) -> IQ4_NL raw blocks [rows, columns / 32 * 18]:
    fp16 d, then byte j holds weight j's table index low and weight j + 16's high; w = d table[q]."""
    rows, columns = weights.shape
    x = weights.astype(np.float32).reshape(-1, 32)
    extreme = np.take_along_axis(x, np.abs(x).argmax(axis=-1)[:, None], axis=-1)
    d = (extreme / -127).astype(np.float16)  # the largest magnitude goes to the table's -127
    table = np.array(IQ4_NL.kvalues, dtype=np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = np.where(d != 0, x / d.astype(np.float32), 0)
    q = np.abs(scaled[..., None] - table).argmin(axis=-1).astype(np.uint8)
    packed = np.concatenate([d.view(np.uint8), q[:, :16] | (q[:, 16:] << 4)], axis=1)
    return packed.reshape(rows, columns // 32 * 18)


# gguf-py's quantize() for the formats it cannot write: float32 [rows, columns] -> raw blocks.
WRITERS: dict[GGMLQuantizationType, Callable[[np.ndarray], np.ndarray]] = {
    GGMLQuantizationType.Q3_K: quantize_q3_k,
    GGMLQuantizationType.Q4_K: quantize_q4_k,
    GGMLQuantizationType.Q5_K: quantize_q5_k,
    GGMLQuantizationType.Q6_K: quantize_q6_k,
    GGMLQuantizationType.IQ4_NL: quantize_iq4_nl,
}
