"""A Triton paged-attention kernel: prefill chunks and decodes in one launch, reading K/V
blocks in place through each sequence's block table (no gather of the context).

One program computes one query tile of one sequence for one KV head. A tile holds whole
tokens, each with its KV head's query group in the tile's rows (row = token * group + g), so
grouped-query attention loads each K/V block once for the whole group. Tiles are numbered
across the step, sequence after sequence: sequence i's tiles start at
query_starts[i] // TILE_TOKENS + i, so the grid needs only the step's token and sequence
counts, never its longest query (a CUDA graph captures it once for any mix of prefill chunks
and decodes), and a short helper table maps each tile to its sequence:

    grid = (num_tokens // TILE_TOKENS + num_seqs, num_kv_heads)
    program: rows of Q [BLOCK_M, head_dim]  x  keys 0 .. last visible, BLOCK_N at a time,
             each key's slot = block_table[seq, key // block_size] * block_size + key % block_size

Online softmax in float32 (FlashAttention-2); a query at position p sees keys 0..p, or
p - window + 1..p in a sliding-window layer (keys before the tile's first window are never
loaded: their blocks may already be another sequence's). Per layer too: the scale, a logit
softcap (Gemma 2) and attention sinks (gpt-oss, one logit per head joining the softmax).
Importing this module needs triton; `loom_shard.attention.backend` decides whether to.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # query rows per program at least: tl.dot's minimum
BLOCK_N = 64  # keys per iteration


@triton.jit
def _paged_attention_kernel(
    q_ptr, kv_ptr, out_ptr, block_tables_ptr, query_starts_ptr, num_cached_ptr, tile_seqs_ptr, sinks_ptr,
    scale, window, softcap,
    stride_q_token, stride_q_head,
    stride_kv_kind, stride_kv_slot, stride_kv_head,
    stride_out_token, stride_out_head,
    stride_table_seq,
    GROUP: tl.constexpr, TILE_TOKENS: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seqs_ptr + tile_id)
    query_start = tl.load(query_starts_ptr + seq)
    query_len = tl.load(query_starts_ptr + seq + 1) - query_start
    first_token = (tile_id - query_start // TILE_TOKENS - seq) * TILE_TOKENS  # of this tile, in its sequence
    if first_token >= query_len:
        return  # a spare tile: the numbering gives each sequence one more than it may need
    num_cached = tl.load(num_cached_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    token = first_token + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < TILE_TOKENS * GROUP) & (token < query_len)
    dims = tl.arange(0, DIM_PAD)  # head_dim padded to a power of two (Phi-3's 96): masked dims are 0
    dim_valid = dims < HEAD_DIM
    q_offsets = (query_start + token)[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)  # [BLOCK_M, DIM_PAD]
    query_pos = num_cached + token  # [BLOCK_M]
    # Keys this tile can see: up to its last valid token's position, inclusive.
    last_token = tl.minimum(first_token + TILE_TOKENS, query_len) - 1
    num_keys = num_cached + last_token + 1

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: a fully masked row never makes NaN
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], dtype=tl.float32)
    table = block_tables_ptr + seq * stride_table_seq
    # With a window, the tile's first query sees keys from tile_first_key on; blocks of BLOCK_N
    # stay on the grid fixed from key 0, so a row's arithmetic does not depend on its tile.
    tile_first_key = 0
    if window > 0:
        tile_first_key = tl.maximum(num_cached + first_token + 1 - window, 0)
    first_key = (tile_first_key // BLOCK_N) * BLOCK_N
    while first_key < num_keys:  # a while loop: the interpreter's scalars are not Python ints
        keys = first_key + tl.arange(0, BLOCK_N)
        key_valid = (keys < num_keys) & (keys >= tile_first_key)
        page = tl.load(table + keys // PAGE, mask=key_valid, other=0)
        slots = page.to(tl.int64) * PAGE + keys % PAGE
        kv_offsets = slots[:, None] * stride_kv_slot + kv_head * stride_kv_head + dims[None, :]
        kv_mask = key_valid[:, None] & dim_valid[None, :]
        k = tl.load(kv_ptr + kv_offsets, mask=kv_mask, other=0.0)  # [BLOCK_N, DIM_PAD]
        v = tl.load(kv_ptr + stride_kv_kind + kv_offsets, mask=kv_mask, other=0.0)
        if IEEE:  # float32 caches: exact float32 products (tf32 would break parity with the reference)
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = scores * scale
        if HAS_SOFTCAP:  # softcap * tanh(scores / softcap), tanh through exp (no tl.tanh everywhere)
            scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
        visible = (keys[None, :] <= query_pos[:, None]) & key_valid[None, :]
        if window > 0:
            visible = visible & (keys[None, :] > query_pos[:, None] - window)
        scores = tl.where(visible, scores, -1.0e30)
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        p = tl.where(visible, p, 0.0)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
        first_key += BLOCK_N
    if HAS_SINKS:  # one more logit per head in the softmax's denominator
        sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0).to(tl.float32)
        m_final = tl.maximum(m_i, sink)
        rescale = tl.exp(m_i - m_final)
        acc = acc * rescale[:, None]
        l_i = l_i * rescale + tl.exp(sink - m_final)
    out = acc / tl.maximum(l_i, 1.0e-30)[:, None]
    out_offsets = (query_start + token)[:, None] * stride_out_token + head[:, None] * stride_out_head + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])


def tile_tokens(group: int) -> int:
    """Tokens per query tile: as many whole query groups as BLOCK_M rows hold (at least one)."""
    return max(BLOCK_M // group, 1)


def tile_seqs(query_starts: torch.Tensor, num_tokens: int, group: int) -> torch.Tensor:
    """Each tile's sequence, [num_tokens // tile_tokens + num_seqs] int32, from the query starts
    on the device (device ops only: graph-capturable; one table serves every layer of a step)."""
    per_tile = tile_tokens(group)
    num_seqs = query_starts.shape[0] - 1
    seqs = torch.arange(num_seqs, device=query_starts.device, dtype=torch.int32)
    first_tiles = query_starts[:-1] // per_tile + seqs  # strictly increasing
    tiles = torch.arange(num_tokens // per_tile + num_seqs, device=query_starts.device, dtype=torch.int32)
    return (torch.searchsorted(first_tiles, tiles, right=True) - 1).to(torch.int32)


def paged_attention_triton(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    query_starts: torch.Tensor,
    num_cached: torch.Tensor,
    tiles: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of every query token over its sequence's cached keys (its own K/V already written).

    q: [num_tokens, num_heads, head_dim]; kv_layer: [2, num_blocks, block_size, kv_heads, head_dim];
    block_tables: [num_seqs, max_blocks] int32; query_starts: [num_seqs + 1] int32 (token offsets
    of each sequence's queries in q); num_cached: [num_seqs] int32 (keys before its first query);
    tiles: `tile_seqs(query_starts, num_tokens, group)`, built here when not given;
    scale (default head_dim ** -0.5), window, softcap, sinks [num_heads]: the layer's spec.
    Returns [num_tokens, num_heads, head_dim].
    """
    num_tokens, num_heads, head_dim = q.shape
    _, num_blocks, page, num_kv_heads, _ = kv_layer.shape
    assert kv_layer.is_contiguous() and q.stride(2) == 1
    assert head_dim % 16 == 0, "head_dim must be a multiple of 16"
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if tiles is None:
        tiles = tile_seqs(query_starts, num_tokens, group)
    sinks_arg = sinks.float().contiguous() if sinks is not None else q  # any pointer when unused
    _paged_attention_kernel[(tiles.shape[0], num_kv_heads)](
        q, kv_layer, out, block_tables, query_starts, num_cached, tiles, sinks_arg,
        head_dim**-0.5 if scale is None else scale, window or 0, softcap or 0.0,
        q.stride(0), q.stride(1),
        kv_layer.stride(0), kv_layer.stride(2), kv_layer.stride(3),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        GROUP=group, TILE_TOKENS=tile_tokens(group), HEAD_DIM=head_dim, DIM_PAD=triton.next_power_of_2(head_dim),
        PAGE=page, BLOCK_M=max(BLOCK_M, triton.next_power_of_2(group)), BLOCK_N=BLOCK_N,
        IEEE=q.dtype == torch.float32, HAS_SINKS=sinks is not None, HAS_SOFTCAP=softcap is not None,
    )
    return out
