"""Weight-only quantized linears: GGUF Q4_1 / Q8_0 weights kept quantized (Q4_0 and Q4_K as Q4_1; Q5_0, IQ4_NL
and IQ4_XS as Q8_0; Q3_K and Q6_K as Q8_16; Q5_1 and Q5_K as Q8_M), bf16 or float32 activations.

With Loom's CPU kernels the GGUF blocks are repacked once into `loom::qlinear`'s tiles and run
llama.cpp's way: each activation row is quantized per block of 32 to int8 (Q8_0-like) and multiplied
with AVX-512 VNNI int8 dot products, float32 accumulation in a fixed order per output (rows are
batch-invariant; one arithmetic for every row count). Without them, Q4_1 runs on torch's int4pack CPU
kernel (groups of 32, unquantized activations; also batch-invariant) and the int8 formats are dequantized
to the activations' dtype, so a shard without a compiler still serves the same model.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from gguf.quants import IQ4_NL, IQ4_XS, Q3_K, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K
from torch import nn

from loom_shard import kernels

BLOCK = 32  # inputs per GGUF quantization block


class QuantKind(enum.Enum):
    """The block formats QuantLinear runs, 32 inputs a block: GGUF's Q4_1 and Q8_0, and Loom's Q8_16
    and Q8_M, which other GGUF formats are rewritten to at load (KEPT_AS)."""

    Q4_1 = enum.auto()  # fp16 d, fp16 m, 16 bytes of nibbles: w = d q + m
    Q8_0 = enum.auto()  # fp16 d, 32 int8: w = d q
    Q8_16 = enum.auto()  # fp16 d0, fp16 d1, 32 int8: w = d0 q for inputs 0..15, d1 q for 16..31 (Q3_K, Q6_K)
    Q8_M = enum.auto()  # fp16 d, fp16 m, 32 int8: w = d q + m (Q5_1's and Q5_K's unsigned q)

    @property
    def scales(self) -> int:
        """fp16 scales at the start of a block (d; d and m; d0 and d1)."""
        return 1 if self is QuantKind.Q8_0 else 2

    @property
    def has_min(self) -> bool:
        return self in (QuantKind.Q4_1, QuantKind.Q8_M)

    @property
    def block_bytes(self) -> int:
        return 2 * self.scales + (BLOCK // 2 if self is QuantKind.Q4_1 else BLOCK)


@dataclass(slots=True)
class QuantSource:
    """A quantized weight [out_features, in_features] as the GGUF stores it: raw blocks, one row each."""

    kind: QuantKind
    raw: torch.Tensor  # uint8 [out_features, in_features / 32 * bytes per block]
    in_features: int
    file_kind: str = ""  # the file's format where it was converted to `kind` (KEPT_AS), else ""

    @property
    def out_features(self) -> int:
        return self.raw.shape[0]

    @staticmethod
    def cat(parts: list[QuantSource]) -> QuantSource:
        """Row concatenation (fused projections); every part must have the same kind and width."""
        first = parts[0]
        if any(p.kind is not first.kind or p.in_features != first.in_features for p in parts):
            raise ValueError("cannot fuse quantized weights of different kinds or widths")
        file_kind = first.file_kind if all(p.file_kind == first.file_kind for p in parts) else ""
        return QuantSource(first.kind, torch.cat([p.raw for p in parts]), first.in_features, file_kind)

    def rows(self, index: torch.Tensor | slice) -> QuantSource:
        return QuantSource(self.kind, self.raw[index].contiguous(), self.in_features, self.file_kind)

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(q as int16 [N, K], d float32 [N, K/32] (Q8_16: [N, K/16]), m float32 [N, K/32] or None)
        from the raw blocks."""
        n, nb, kind = self.out_features, self.in_features // BLOCK, self.kind
        blocks = self.raw.reshape(n, nb, kind.block_bytes)
        head = 2 * kind.scales
        scales = blocks[..., :head].contiguous().view(torch.float16).float()  # [n, nb, scales]
        if kind is QuantKind.Q4_1:
            nibbles = blocks[..., head:].to(torch.int16)
            q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1)  # element j low nibble, j + 16 high
        else:
            q = blocks[..., head:].contiguous().view(torch.int8).to(torch.int16)
        if kind.has_min:
            return q.reshape(n, -1), scales[..., 0], scales[..., 1]
        return q.reshape(n, -1), scales.reshape(n, -1), None

    def dequantize(self) -> torch.Tensor:
        """float32 [out_features, in_features], as gguf-py's dequantize computes it."""
        q, d, m = self.blocks()
        w = q.float().reshape(*d.shape, -1) * d[..., None]
        if m is not None:
            w = w + m[..., None]
        return w.reshape(self.out_features, self.in_features)


class QuantLinear(nn.Module):
    """y = x W^T (+ bias) with W quantized. Buffers are not persistent: the state dict keeps only the bias."""

    def __init__(self, source: QuantSource, bias: torch.Tensor | None, dtype: torch.dtype,
                 use_kernels: bool | None = None) -> None:
        super().__init__()
        self.kind = source.kind
        self.file_kind = source.file_kind or source.kind.name  # what the GGUF holds (Q4_0 runs as Q4_1)
        self.in_features, self.out_features = source.in_features, source.out_features
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.uses_kernels = kernels.available() if use_kernels is None else use_kernels
        # Tensors are integer typed so that Module.to(dtype) leaves them alone.
        if self.uses_kernels:
            repack = getattr(kernels.ops(), f"qlinear_repack_{source.kind.name.lower()}")
            packed, scales = repack(source.raw.contiguous(), source.in_features)
            self.register_buffer("packed", packed, persistent=False)
            self.register_buffer("scales", scales.view(torch.int16), persistent=False)
        elif source.kind is QuantKind.Q4_1:
            packed, scales_zeros = _int4pack(source)
            self.register_buffer("packed", packed, persistent=False)
            self.register_buffer("scales", scales_zeros.view(torch.int32), persistent=False)
        else:
            self.register_buffer("packed", source.dequantize().to(dtype), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.uses_kernels:
            return kernels.ops().qlinear(x, self.packed, self.scales.view(torch.float16), self.out_features, self.bias)
        if self.kind is QuantKind.Q4_1:
            shape = x.shape
            x2 = x.reshape(-1, self.in_features)
            scales = self.scales.view(torch.float32).to(x.dtype)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, BLOCK, scales)
            y = y.reshape(*shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias.to(y.dtype)
        return F.linear(x, self.packed.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        backend = "loom kernels" if self.uses_kernels else "torch"
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind.name}, {backend}"


def _int4pack(source: QuantSource) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's int4pack CPU layout: w = (q - 8) scale + zero, so Q4_1's d q + m is scale d, zero m + 8 d."""
    q, d, m = source.blocks()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    scales_zeros = torch.stack([d, m + 8 * d], dim=-1).transpose(0, 1).contiguous()  # [K/32, N, 2]
    return packed, scales_zeros


def raw_source(kind: QuantKind, raw: np.ndarray, in_features: int, file_kind: str = "") -> QuantSource:
    """A QuantSource owning a copy of the GGUF bytes (the file's memory map stays read-only)."""
    return QuantSource(kind, torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True)), in_features, file_kind)


def _blocks(raw: np.ndarray, block_bytes: int) -> np.ndarray:
    """A tensor's raw rows as one row per block."""
    return np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, block_bytes)


def _rows(raw: np.ndarray, *columns: np.ndarray) -> np.ndarray:
    """Rewritten blocks (their columns of bytes side by side) back in raw's rows."""
    return np.concatenate(columns, axis=1).reshape(raw.shape[0], -1)


_ONE, _ZERO = (np.array([v], dtype=np.float16).view(np.uint8) for v in (1.0, 0.0))
_UNIT_SCALES = np.array([1] * 4 + [0] * 4 + [1] * 4, dtype=np.uint8)  # Q4_K's packing of every sc 1, every min 0


def _integers(blocks: np.ndarray, quant: type, unit: dict[int, np.ndarray]) -> np.ndarray:
    """A format's integers (int8, in input order) as gguf-py's dequantization gives them where
    every scale is 1 and every min 0: `unit` holds those bytes by their offset in a block."""
    blocks = blocks.copy()
    for offset, value in unit.items():
        blocks[:, offset : offset + len(value)] = value
    return quant.dequantize_blocks(blocks).astype(np.int8)


def q4_0_as_q4_1(raw: np.ndarray) -> np.ndarray | None:
    """GGUF Q4_0 blocks (fp16 d, 16 bytes of nibbles: w = d (q - 8)) as Q4_1 blocks (fp16 d, fp16
    m = -8 d, the same nibbles): the same weights exactly (-8 d is d's exponent plus 3, and d q + m
    equals d (q - 8) in float32), so Q4_0 files run on Q4_1's kernels. None where some -8 d
    overflows fp16 (|d| > 8,188): such a weight is dequantized instead."""
    blocks = _blocks(raw, 18)
    with np.errstate(over="ignore"):  # an overflow is answered below
        m = blocks[:, 0:2].copy().view(np.float16) * np.float16(-8)
    if not np.isfinite(m).all():
        return None
    return _rows(raw, blocks[:, 0:2], m.view(np.uint8), blocks[:, 2:])


def q5_0_as_q8_0(raw: np.ndarray) -> np.ndarray:
    """GGUF Q5_0 blocks (fp16 d, 4 bytes of fifth bits, 16 bytes of nibbles: w = d (q - 16), q in
    0..31) as Q8_0 blocks (fp16 d, int8 q - 16): the same weights exactly, so Q5_0 files run on
    Q8_0's kernels (34 bytes a block of 32 against the file's 22 and bfloat16's 64)."""
    blocks = _blocks(raw, 22)
    return _rows(raw, blocks[:, 0:2], _integers(blocks, Q5_0, {0: _ONE}).view(np.uint8))


def q5_1_as_q8_m(raw: np.ndarray) -> np.ndarray:
    """GGUF Q5_1 blocks (fp16 d and m, fifth bits, nibbles: w = d q + m, q in 0..31) as Q8_M blocks
    (the same d and m, int8 q): the same weights exactly (36 bytes a block of 32 against the file's
    24 and bfloat16's 64)."""
    blocks = _blocks(raw, 24)
    return _rows(raw, blocks[:, 0:4], _integers(blocks, Q5_1, {0: _ONE, 2: _ZERO}).view(np.uint8))


def q5_k_as_q8_m(raw: np.ndarray) -> np.ndarray | None:
    """GGUF Q5_K super-blocks of 256 (Q4_K's scales and mins, 5-bit q: w = d sc q - dmin mn) as
    eight Q8_M blocks each (fp16 d sc, fp16 -dmin mn, int8 q): the file's integers, each block's
    scale and min rounded to fp16 as Q4_K's are (None where one would leave fp16's normal range)."""
    blocks = _blocks(raw, 176)  # fp16 d, fp16 dmin, 12 bytes of scales and mins, fifth bits, nibbles
    scales_mins = _k_scales_and_mins(blocks)
    if scales_mins is None:
        return None
    q = _integers(blocks, Q5_K, {0: _ONE, 2: _ZERO, 4: _UNIT_SCALES}).reshape(-1, BLOCK)
    return _rows(raw, *scales_mins, q.view(np.uint8))


def _k_scales_and_mins(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Q4_K's and Q5_K's scale d sc and min -dmin mn of every block of 32 (fp16 d and dmin, then 12
    bytes of 6-bit sc and mn), rounded to fp16 as bytes [blocks of 32, 2] each (_fp16_scales)."""
    d, dmin = (blocks[:, i : i + 2].copy().view(np.float16).astype(np.float32) for i in (0, 2))
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])
    rounded = _fp16_scales(np.stack([d * sc, -(dmin * mn)]).reshape(2, -1))
    return None if rounded is None else (rounded[0].view(np.uint8).reshape(-1, 2), rounded[1].view(np.uint8).reshape(-1, 2))


def q4_k_as_q4_1(raw: np.ndarray) -> np.ndarray | None:
    """GGUF Q4_K super-blocks of 256 (fp16 d and dmin, 6-bit scale sc and min mn per 32, 128 bytes
    of nibbles: w = d sc q - dmin mn) as eight Q4_1 blocks each (fp16 d sc, fp16 -dmin mn, the same
    nibbles), so Q4_K files run on Q4_1's kernels. The nibbles are the file's; each block's scale
    and min, exact in float32, are rounded to fp16 (11 significant bits: a relative 2^-11 at most,
    where a weight dequantized to bfloat16 moves by up to 2^-8). None where one would leave fp16's
    normal range (overflow, or a subnormal that loses bits): such a weight is dequantized instead."""
    blocks = _blocks(raw, 144)
    scales_mins = _k_scales_and_mins(blocks)
    if scales_mins is None:
        return None
    q = _integers(blocks, Q4_K, {0: _ONE, 2: _ZERO, 4: _UNIT_SCALES}).view(np.uint8).reshape(-1, BLOCK)
    nibbles = q[:, :16] | (q[:, 16:] << 4)  # Q4_1's byte j: q_j low, q_{j+16} high
    return _rows(raw, *scales_mins, nibbles)


def q6_k_as_q8_16(raw: np.ndarray) -> np.ndarray | None:
    """GGUF Q6_K super-blocks of 256 (fp16 d, int8 scale sc per 16, 6-bit q: w = d sc (q - 32)) as
    eight Q8_16 blocks each (fp16 d sc per 16, int8 q - 32), so Q6_K files run on the int8 kernels
    (36 bytes a block of 32 against the file's 26.25 and bfloat16's 64). The integers are the file's
    (gguf-py unpacks them); each 16's scale, exact in float32, is rounded to fp16 as Q4_K's are. None
    where one would leave fp16's normal range: such a weight is dequantized instead."""
    blocks = _blocks(raw, 210)  # 128 bytes of low nibbles, 64 of high bits, int8 sc[16], fp16 d
    d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
    rounded = _fp16_scales(d * blocks[:, 192:208].view(np.int8).astype(np.float32))  # [super-blocks, 16]
    if rounded is None:
        return None
    q = _integers(blocks, Q6_K, {192: np.ones(16, dtype=np.uint8), 208: _ONE}).reshape(-1, BLOCK)
    return _rows(raw, rounded.view(np.uint8).reshape(-1, 4), q.view(np.uint8))


def q3_k_as_q8_16(raw: np.ndarray) -> np.ndarray | None:
    """GGUF Q3_K super-blocks of 256 (fp16 d, a 6-bit scale sc per 16, 3-bit q: w = d (sc - 32) q,
    q in -4..3) as eight Q8_16 blocks each (fp16 d (sc - 32) per 16, int8 q): the file's integers,
    each 16's scale rounded to fp16 as the other K-quants' (None where one would leave fp16's
    normal range). gguf-py dequantizes both: the scales from the blocks with every q set to 1."""
    blocks = _blocks(raw, 110)  # 32 bytes of high bits, 64 of 2-bit pairs, 12 of scales, fp16 d
    ones = blocks.copy()
    ones[:, 0:32], ones[:, 32:96] = 0xFF, 0x55  # every q 1: a set high bit, then 01 pairs
    step = Q3_K.dequantize_blocks(ones)  # [super-blocks, 256]: each weight's d (sc - 32), exact
    rounded = _fp16_scales(step[:, ::16])
    if rounded is None:
        return None
    with np.errstate(divide="ignore", invalid="ignore"):  # a zero scale: its weights are 0
        q = np.where(step != 0, Q3_K.dequantize_blocks(blocks) / step, 0).astype(np.int8)  # exact
    return _rows(raw, rounded.view(np.uint8).reshape(-1, 4), q.reshape(-1, BLOCK).view(np.uint8))


def iq4_nl_as_q8_0(raw: np.ndarray) -> np.ndarray:
    """GGUF IQ4_NL blocks (fp16 d, 4-bit indices into a table of 16 int8 values: w = d table[q]) as
    Q8_0 blocks (the same d, int8 table[q]): the same weights exactly."""
    blocks = _blocks(raw, 18)
    return _rows(raw, blocks[:, 0:2], _integers(blocks, IQ4_NL, {0: _ONE}).view(np.uint8))


def iq4_xs_as_q8_0(raw: np.ndarray) -> np.ndarray | None:
    """GGUF IQ4_XS super-blocks of 256 (fp16 d, a 6-bit scale ls per 32, IQ4_NL's indices: w =
    d (ls - 32) table[q]) as eight Q8_0 blocks each (fp16 d (ls - 32), int8 table[q]): the file's
    table values, each block's scale rounded to fp16 as the K-quants' are (None where one would
    leave fp16's normal range)."""
    blocks = _blocks(raw, 136)  # fp16 d, 2 bytes of the scales' high bit pairs, 4 of low nibbles, indices
    ones = blocks.copy()
    ones[:, 8:] = 0x88  # every index 8: table value 1
    rounded = _fp16_scales(IQ4_XS.dequantize_blocks(ones)[:, ::BLOCK])  # each block's d (ls - 32), exact
    if rounded is None:
        return None
    unit_scales = {0: _ONE, 2: np.array([0xAA, 0xAA], dtype=np.uint8), 4: np.full(4, 0x11, dtype=np.uint8)}  # ls 33
    q = _integers(blocks, IQ4_XS, unit_scales).reshape(-1, BLOCK)
    return _rows(raw, rounded.view(np.uint8).reshape(-1, 2), q.view(np.uint8))


def _fp16_scales(exact: np.ndarray) -> np.ndarray | None:
    """float32 block scales rounded to fp16 (a relative 2^-11 at most, where a weight dequantized to
    bfloat16 moves by up to 2^-8), or None where one would leave fp16's normal range (overflow, or a
    subnormal that loses bits)."""
    with np.errstate(over="ignore"):  # an overflow is answered below
        rounded = exact.astype(np.float16)
    if np.any(np.abs(rounded.astype(np.float32) - exact) > np.abs(exact) * 2.0**-11):
        return None
    return rounded


def convert_rows(convert: Callable[[np.ndarray], np.ndarray | None], raw: np.ndarray,
                 chunk_bytes: int = 1 << 24) -> np.ndarray | None:
    """`convert` applied to raw's rows about `chunk_bytes` of blocks at a time, so that the float32
    arrays the converters make on the way stay that small whatever the tensor (a vocabulary's head);
    None where `convert` gives None for some rows."""
    step = max(1, chunk_bytes // max(1, raw.shape[1]))
    parts = []
    for first in range(0, raw.shape[0], step):
        part = convert(raw[first : first + step])
        if part is None:
            return None
        parts.append(part)
    return np.concatenate(parts)


# GGUF formats run as a kept one, converted at load (None: not this one): Q4_0, Q5_0, Q5_1 and
# IQ4_NL without changing a weight, the K-quants and IQ4_XS with their block scales in fp16.
KEPT_AS: dict[str, tuple[QuantKind, Callable[[np.ndarray], np.ndarray | None]]] = {
    "Q4_0": (QuantKind.Q4_1, q4_0_as_q4_1),
    "Q5_0": (QuantKind.Q8_0, q5_0_as_q8_0),
    "Q5_1": (QuantKind.Q8_M, q5_1_as_q8_m),
    "Q4_K": (QuantKind.Q4_1, q4_k_as_q4_1),
    "Q5_K": (QuantKind.Q8_M, q5_k_as_q8_m),
    "Q3_K": (QuantKind.Q8_16, q3_k_as_q8_16),
    "Q6_K": (QuantKind.Q8_16, q6_k_as_q8_16),
    "IQ4_NL": (QuantKind.Q8_0, iq4_nl_as_q8_0),
    "IQ4_XS": (QuantKind.Q8_0, iq4_xs_as_q8_0),
}
