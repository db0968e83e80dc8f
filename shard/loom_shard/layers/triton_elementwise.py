"""Triton kernels for a CUDA decoder layer's elementwise work, one launch each: the residual add
with the RMSNorm after it, SiLU(gate) * up, and rotary over q and k reading each token's cos/sin
row itself (torch's path gathers the rows, rolls and multiplies: five launches a layer); and the
sampler's per-row greedy token and log-softmax terms (torch's path: six launches over the logits).

At small batches a decode step is hundreds of launches of 1-4 µs, so launches are its cost
(bench/BENCHMARKS.md, the H200's batch-1 profile). Each program computes whole rows (a token's
hidden vector, or all heads of one token) in one fixed order, so a row's result never depends on
the batch it is in. Arithmetic in float32, rounded once to the tensor's dtype (the add before a
norm rounds as torch's add does, since the sum is the residual stream).
Importing this module needs triton; `loom_shard.layers.elementwise` decides whether to.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SILU_BLOCK = 1024  # columns of one SiLU·mul program
TERMS_BLOCK = 8192  # columns a greedy-terms program reads at a time (8 warps: 32 a thread)
TERMS_WARPS = 8


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, sum_ptr, out_ptr, hidden, eps,
                     stride_x, stride_residual, stride_sum, stride_out,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (xf * rstd * weight).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, intermediate, stride_in, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + intermediate + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(x_ptr, out_ptr, positions_ptr, cos_ptr, sin_ptr, num_heads,
                   stride_x_token, stride_x_head, stride_out_token, stride_out_head, stride_table,
                   HALF: tl.constexpr, HALF_PAD: tl.constexpr, REST: tl.constexpr, REST_PAD: tl.constexpr,
                   HEADS_PAD: tl.constexpr):
    token = tl.program_id(0)
    position = tl.load(positions_ptr + token)
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < num_heads) & (dims < HALF)
    cos = tl.load(cos_ptr + position * stride_table + dims, mask=dims < HALF, other=0.0)
    sin = tl.load(sin_ptr + position * stride_table + dims, mask=dims < HALF, other=0.0)
    src = x_ptr + token * stride_x_token + heads * stride_x_head
    dst = out_ptr + token * stride_out_token + heads * stride_out_head
    first = tl.load(src + dims, mask=mask, other=0.0).to(tl.float32)
    second = tl.load(src + HALF + dims, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst + dims, (first * cos - second * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF + dims, (second * cos + first * sin).to(out_ptr.dtype.element_ty), mask=mask)
    if REST > 0:  # partial rotary: the dims past 2 * HALF pass through
        rest = tl.arange(0, REST_PAD)[None, :]
        rest_mask = (heads < num_heads) & (rest < REST)
        tl.store(dst + 2 * HALF + rest, tl.load(src + 2 * HALF + rest, mask=rest_mask), mask=rest_mask)


@triton.jit
def _greedy_terms_kernel(logits_ptr, argmax_ptr, max_ptr, log_sum_ptr, vocab, stride, BLOCK: tl.constexpr):
    """One row in one pass, in a fixed order: its first greatest logit (the first NaN where there
    is one, as torch.argmax), the max, and log(sum(exp(logit - max))). Each lane keeps its own
    max, first index of it and sum of exps scaled to that max; the lanes are combined at the end."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    cols = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_at = tl.zeros([BLOCK], tl.int32)
    total = tl.zeros([BLOCK], tl.float32)  # sum of exp(x - best) over the lane's logits so far
    first_nan = tl.full([BLOCK], vocab, tl.int32)
    for start in range(0, vocab, BLOCK):
        index = start + cols
        x = tl.load(base + index, mask=index < vocab, other=float("-inf"))
        is_nan = x != x
        first_nan = tl.minimum(first_nan, tl.where(is_nan, index, vocab))
        x = tl.where(is_nan, float("-inf"), x)
        better = x > best
        top = tl.where(better, x, best)
        # a lane that has seen only masked logits (top -inf) keeps a sum of 0, without -inf - -inf
        seen = top != float("-inf")
        total = total * tl.exp(tl.where(seen, best - top, 0.0)) + tl.exp(tl.where(seen, x - top, float("-inf")))
        best_at = tl.where(better, index, best_at)
        best = top
    row_max = tl.max(best, axis=0)
    argmax = tl.min(tl.where(best == row_max, best_at, vocab), axis=0)
    scale = tl.exp(tl.where(best != float("-inf"), best - row_max, float("-inf")))
    log_sum = tl.log(tl.sum(total * scale, axis=0))
    nan_at = tl.min(first_nan, axis=0)
    tl.store(argmax_ptr + row, tl.where(nan_at < vocab, nan_at, argmax).to(tl.int64))
    tl.store(max_ptr + row, tl.where(nan_at < vocab, float("nan"), row_max))
    tl.store(log_sum_ptr + row, tl.where(nan_at < vocab, float("nan"), log_sum))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim] with unit stride along the last dim (a view where it can be)."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def _norm_warps(block: int) -> int:
    return min(max(block // 512, 1), 8)


def _norm_rows(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
               eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, or x itself, as rows; the RMSNorm of those rows)."""
    rows = _rows(x)
    res = rows if residual is None else _rows(residual)
    total = rows if residual is None else torch.empty_like(rows)  # never written without a residual
    out = torch.empty_like(rows)
    block = triton.next_power_of_2(rows.shape[1])
    _rms_norm_kernel[(rows.shape[0],)](rows, res, weight, total, out, rows.shape[1], eps,
                                       rows.stride(0), res.stride(0), total.stride(0), out.stride(0),
                                       HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_norm_warps(block))
    return total, out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of x [..., hidden]."""
    return _norm_rows(x, None, weight, eps)[1].view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, its RMSNorm) in one pass over each row."""
    total, out = _norm_rows(x, residual, weight, eps)
    return total.view(x.shape), out.view(x.shape)


def silu_mul(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    """[..., 2 * intermediate] (gate, then up) -> silu(gate) * up [..., intermediate]."""
    rows = _rows(gate_up)
    out = torch.empty(rows.shape[0], intermediate, dtype=rows.dtype, device=rows.device)
    grid = (rows.shape[0], triton.cdiv(intermediate, SILU_BLOCK))
    _silu_mul_kernel[grid](rows, out, intermediate, rows.stride(0), out.stride(0), BLOCK=SILU_BLOCK)
    return out.view(*gate_up.shape[:-1], intermediate)


def rotary(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, head_dim] (any token and head strides) rotated at each token's position;
    cos and sin are float32 [table_len, rotary_dim // 2] (half-split layout)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    num_tokens, num_heads, head_dim = x.shape
    half = cos.shape[1]
    rest = head_dim - 2 * half
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _rotary_kernel[(num_tokens,)](
        x, out, positions, cos, sin, num_heads, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        cos.stride(0), HALF=half, HALF_PAD=triton.next_power_of_2(half), REST=rest,
        REST_PAD=triton.next_power_of_2(rest) if rest else 0, HEADS_PAD=triton.next_power_of_2(num_heads),
    )
    return out


def greedy_logprob_terms(logits: torch.Tensor, block: int = TERMS_BLOCK,
                         warps: int = TERMS_WARPS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of float32 logits [rows, vocab], one launch: (argmax, max, log(sum(exp(row - max)))).
    Each row is one program's, so a row's terms do not depend on the batch around it; it reads
    `block` columns at a time with `warps` warps (fewer for a small vocabulary)."""
    rows = _rows(logits)
    num_rows, vocab = rows.shape
    argmax = torch.empty(num_rows, dtype=torch.long, device=rows.device)
    row_max = torch.empty(num_rows, dtype=torch.float32, device=rows.device)
    log_sum = torch.empty(num_rows, dtype=torch.float32, device=rows.device)
    if num_rows:
        block = min(block, triton.next_power_of_2(vocab))
        _greedy_terms_kernel[(num_rows,)](rows, argmax, row_max, log_sum, vocab, rows.stride(0), BLOCK=block,
                                          num_warps=min(warps, max(block // 256, 1)))
    return argmax, row_max, log_sum


def self_check(device: torch.device, dtype: torch.dtype) -> None:
    """Compile and run each kernel once on small inputs of `dtype` on `device` and compare it with
    torch's float32 ops; raises (a compile error, or AssertionError naming the kernel) where they
    disagree. Shapes that are no powers of two, partial rotary, a strided input."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device, dtype)

    x, residual, weight = rand(3, 100), rand(3, 100), rand(100)
    total, normed = add_rms_norm(x, residual, weight, 1e-5)
    reference = torch.rms_norm(total.float(), (100,), weight.float(), 1e-5)
    _agree("add_rms_norm (sum)", total, x + residual, dtype)
    _agree("add_rms_norm (norm)", normed, reference, dtype)
    _agree("rms_norm", rms_norm(total, weight, 1e-5), reference, dtype)
    gate_up = rand(3, 2 * 50)
    gate, up = gate_up.float().split(50, dim=-1)
    _agree("silu_mul", silu_mul(gate_up, 50), torch.nn.functional.silu(gate) * up, dtype)
    qk = rand(5, 3, 12)[:, :2]  # a token stride of 3 heads: q of a fused qkv
    positions = torch.tensor([0, 7, 2, 9, 4], device=device)
    angles = torch.rand(10, 4, generator=gen).to(device) * 6
    cos, sin = angles.cos(), angles.sin()
    first, second, rest = qk.float().split([4, 4, 4], dim=-1)
    c, s_ = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    expected = torch.cat([first * c - second * s_, second * c + first * s_, rest], dim=-1)
    _agree("rotary", rotary(qk, positions, cos, sin), expected, dtype)
    logits = torch.randn(3, TERMS_BLOCK + 100, generator=gen).to(device) * 6  # float32 in any model dtype
    logits[1, -1] = logits[1].max() + 1  # the greatest in the last, partial block
    argmax, row_max, log_sum = greedy_logprob_terms(logits)
    assert torch.equal(argmax, logits.argmax(dim=-1)), "greedy_logprob_terms: another token than torch's argmax"
    _agree("greedy_logprob_terms", (logits - row_max[:, None]) - log_sum[:, None], logits.log_softmax(-1), torch.float32)


def _agree(name: str, actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    error = (actual.float() - expected.float()).abs().max().item()
    scale = max(expected.float().abs().max().item(), 1.0)
    assert error <= tolerance * scale, f"{name}: off by {error:.3g} from torch's ops ({dtype})"
