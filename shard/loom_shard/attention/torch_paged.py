"""Attention over the paged KV cache for one mixed batch (prefill chunks and decodes).

`AttentionMetadata` is built once per step and shared by every layer. Tokens are
laid out prefill chunks first, then all decode tokens:

    tokens: [ prefill 0 chunk | prefill 1 chunk | d0 d1 d2 ... ]
              blocked causal attention each      one padded batched attention for all decodes

A layer first writes its new K/V at each token's slot
(slot = block_table[pos // block_size] * block_size + pos % block_size), then
each sequence attends over its own blocks only. What differs between layers (the scale, a
sliding window, a logit softcap, attention sinks) travels in an `AttentionSpec`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loom_shard.attention.metadata import AttentionMetadata, AttentionSpec, DecodeBatch, PrefillChunk


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata,
    spec: AttentionSpec,
) -> torch.Tensor:
    """Write k/v into the cache, then attend. Returns [num_tokens, num_heads * head_dim].

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim];
    kv_layer: this layer's cache [2, num_blocks, block_size, num_kv_heads, head_dim].
    """
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_layer.shape
    flat = kv_layer.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat[0].index_copy_(0, meta.slot_mapping, k)
    flat[1].index_copy_(0, meta.slot_mapping, v)
    if meta.paged is not None:
        return meta.paged.kernel(q, kv_layer, meta.paged, spec).reshape(q.shape[0], -1)
    outputs = [_prefill(q, k, v, kv_layer, chunk, spec) for chunk in meta.prefills]
    if meta.decode is not None:
        outputs.append(_decode(q[meta.decode.start :], kv_layer, meta.decode, spec))
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
    return out.reshape(q.shape[0], -1)


def _prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, chunk: PrefillChunk, spec: AttentionSpec
) -> torch.Tensor:
    if chunk.block_ids is None:
        key = k[chunk.start : chunk.end].transpose(0, 1)  # [kv_heads, chunk_len, head_dim]
        value = v[chunk.start : chunk.end].transpose(0, 1)
    else:
        context = chunk.num_cached + chunk.end - chunk.start
        kv = kv_layer.permute(0, 3, 1, 2, 4).index_select(2, chunk.block_ids)  # [2, kv_heads, blocks, block, hd]
        kv = kv.flatten(2, 3)[:, :, :context]
        key, value = kv[0], kv[1]
    query = q[chunk.start : chunk.end]
    if query.is_cuda and spec.is_plain_causal:
        return sdpa_causal_attention(query, key, value, spec.scale)
    return blocked_causal_attention(query, key, value, chunk.num_cached, spec=spec)


def sdpa_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          scale: float | None = None) -> torch.Tensor:
    """The same contract as `blocked_causal_attention`, through SDPA's fused kernels (CUDA):
    a lower-right causal bias aligns the diagonal with the chunk's end after cached keys."""
    # Imported here: torch.nn.attention.bias imports torch._dynamo, ~1 s of every shard's start,
    # and only CUDA without triton comes here.
    from torch.nn.attention.bias import causal_lower_right

    chunk_len, context = query.shape[0], key.shape[1]
    bias = causal_lower_right(chunk_len, context) if context != chunk_len else None
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1), key, value, attn_mask=bias, is_causal=bias is None, enable_gqa=True, scale=scale
    )
    return out.transpose(0, 1)  # [chunk_len, num_heads, head_dim]


# Query rows per tile: big enough for the matmuls to run near peak, small enough that the
# float32 score tile ([kv_heads, rows, context]) stays in cache and masked tiles are skipped.
TILE_ROWS = 512


def blocked_causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, num_cached: int, tile_rows: int = TILE_ROWS,
    spec: AttentionSpec | None = None,
) -> torch.Tensor:
    """Causal attention of a chunk that starts after num_cached keys, as tiles of plain matmuls.

    query: [chunk_len, num_heads, head_dim]; key, value: [kv_heads, num_cached + chunk_len, head_dim].
    Returns [chunk_len, num_heads, head_dim]. On CPU this beats SDPA several times over: the
    matmuls run at the bf16/fp32 peak and each query tile only reads the keys it can see.
    spec: the layer's scale, window, softcap and sinks (None: plain, scaled by head_dim ** -0.5).
    """
    chunk_len, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[0]
    group = num_heads // num_kv_heads
    spec = spec or AttentionSpec(head_dim**-0.5)
    # Each kv head's query group folds into its rows (row = token * group + g): no K/V repeat,
    # and a tile of rows covers consecutive positions, so it sees a prefix of the keys.
    rows = (query * spec.scale).view(chunk_len, num_kv_heads, group, head_dim).transpose(0, 1)
    rows = rows.reshape(num_kv_heads, chunk_len * group, head_dim)
    key_t = key.transpose(1, 2)
    tile = max(1, tile_rows // group)  # tokens per tile
    # Row r of a tile holds token r // group; it must not see the tile's later tokens.
    row_token = torch.arange(min(tile, chunk_len) * group, device=query.device).div(group, rounding_mode="floor")
    hidden = row_token.unsqueeze(1) < torch.arange(min(tile, chunk_len), device=query.device).unsqueeze(0)
    out = torch.empty_like(rows)
    for first in range(0, chunk_len, tile):
        last = min(first + tile, chunk_len)
        visible = num_cached + last
        r0, r1 = first * group, last * group
        scores = torch.matmul(rows[:, r0:r1], key_t[:, :, :visible]).float()  # [kv_heads, tile rows, visible]
        if spec.softcap is not None:
            scores = torch.tanh(scores / spec.softcap) * spec.softcap
        diagonal = scores[:, :, num_cached + first :]
        diagonal.masked_fill_(hidden[: r1 - r0, : last - first], float("-inf"))
        if spec.window is not None:
            row_pos = num_cached + first + row_token[: r1 - r0]  # [tile rows]
            before = torch.arange(visible, device=query.device) <= (row_pos - spec.window).unsqueeze(1)
            scores.masked_fill_(before, float("-inf"))
        probs = _softmax(scores, spec.sinks, group, r0).to(value.dtype)
        torch.matmul(probs, value[:, :visible], out=out[:, r0:r1])
    return out.view(num_kv_heads, chunk_len, group, head_dim).transpose(0, 1).reshape(chunk_len, num_heads, head_dim)


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None, group: int, first_row: int) -> torch.Tensor:
    """Softmax over the last dim of scores [kv_heads, rows, keys]; with sinks, each row's head
    (kv_head * group + (first_row + row) % group) adds its sink logit to the denominator."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    num_kv_heads, num_rows = scores.shape[:2]
    heads = torch.arange(num_kv_heads, device=scores.device).unsqueeze(1) * group + (
        torch.arange(first_row, first_row + num_rows, device=scores.device) % group)
    sink = sinks.float()[heads].unsqueeze(-1)  # [kv_heads, rows, 1]
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


def _decode(q: torch.Tensor, kv_layer: torch.Tensor, batch: DecodeBatch, spec: AttentionSpec) -> torch.Tensor:
    num_decodes, num_heads, head_dim = q.shape
    num_kv_heads = kv_layer.shape[3]
    group = num_heads // num_kv_heads
    # One query token per sequence: each kv head's query group becomes its query rows,
    # so grouped-query attention needs no K/V repeat. Batched over [kv_heads, decodes].
    query = q.view(num_decodes, num_kv_heads, group, head_dim).transpose(0, 1)
    # Gathering from a head-major view copies K/V once, straight into the layout the
    # matmuls want (faster on CPU than advanced indexing + SDPA; bench/BENCHMARKS.md).
    kv = kv_layer.permute(0, 3, 1, 2, 4).index_select(2, batch.block_ids.view(-1))
    kv = kv.view(2, num_kv_heads, num_decodes, -1, head_dim)  # [2, kv_heads, decodes, context, head_dim]
    scores = torch.matmul(query, kv[0].transpose(-1, -2))  # [kv_heads, decodes, group, context]
    if not spec.is_plain_causal:
        return _decode_special(scores, kv, batch, spec, q.shape)
    # One op scales, adds the float32 padding mask and so promotes to float32 (each tiny op
    # costs a few microseconds per layer at batch 1).
    scores = torch.add(batch.mask, scores, alpha=spec.scale)
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    out = torch.matmul(probs, kv[1])  # [kv_heads, decodes, group, head_dim]
    return out.transpose(0, 1).reshape(num_decodes, num_heads, head_dim)


def _decode_special(scores: torch.Tensor, kv: torch.Tensor, batch: DecodeBatch, spec: AttentionSpec,
                    q_shape: torch.Size) -> torch.Tensor:
    """The decode path's softmax and P.V with a window, a softcap or sinks (scores unscaled,
    [kv_heads, decodes, group, context])."""
    num_decodes, num_heads, head_dim = q_shape
    num_kv_heads, _, group, context = scores.shape
    scores = scores.float() * spec.scale
    if spec.softcap is not None:
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
    scores = scores + batch.mask  # [decodes, 1, context] broadcast over kv heads and group
    if spec.window is not None:
        key_pos = torch.arange(context, device=scores.device)
        before = key_pos.unsqueeze(0) < batch.context_lens - spec.window  # [decodes, context]
        scores = scores.masked_fill(before.unsqueeze(1), float("-inf"))
    if spec.sinks is not None:
        sink = spec.sinks.float().view(num_kv_heads, 1, group, 1).expand(-1, num_decodes, -1, -1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs.to(kv.dtype), kv[1])  # [kv_heads, decodes, group, head_dim]
    return out.transpose(0, 1).reshape(num_decodes, num_heads, head_dim)
