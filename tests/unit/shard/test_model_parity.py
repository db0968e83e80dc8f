"""Loom's model against transformers on the same random weights, over mixed paged batches."""

from __future__ import annotations

import random

import pytest
import torch

from tests.unit.shard.conftest import SeqChunk, hf_logits, make_cache, make_pair, random_tokens, run_chunks

BLOCK_SIZE = 4


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-4) -> None:
    # Relative to the logits' scale, so near-zero entries do not demand absolute exactness.
    scale = expected.abs().max().item()
    err = (actual - expected).abs().max().item()
    assert err <= rtol * scale, f"max error {err:.3g} exceeds {rtol} x scale {scale:.3g}"


@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama3"])
def test_mixed_batch_matches_transformers(kind: str) -> None:
    pair = make_pair(kind)
    cache = make_cache(pair.loom, BLOCK_SIZE, num_blocks=32)
    ids = list(range(32))
    random.Random(1).shuffle(ids)  # block tables in no particular order
    a, b, c = random_tokens(50, 1), random_tokens(13, 2), random_tokens(9, 3)
    ta, tb, tc = ids[:13], ids[13:17], ids[17:20]
    # Step 1: a prefills a first chunk, b its whole prompt, c all but its last token.
    first = run_chunks(pair.loom, cache, [SeqChunk(a, 0, 20, ta), SeqChunk(b, 0, 12, tb), SeqChunk(c, 0, 8, tc)])
    # Step 2: a's chunk starts after cached tokens; b and c decode one token each.
    second = run_chunks(pair.loom, cache, [SeqChunk(a, 20, 30, ta), SeqChunk(b, 12, 1, tb), SeqChunk(c, 8, 1, tc)])
    ref_a, ref_b, ref_c = hf_logits(pair.hf, a), hf_logits(pair.hf, b), hf_logits(pair.hf, c)
    _assert_close(first[0], ref_a[:20])
    _assert_close(second[0], ref_a[20:50])
    _assert_close(first[1], ref_b[:12])
    _assert_close(second[1], ref_b[12:13])
    _assert_close(first[2], ref_c[:8])
    _assert_close(second[2], ref_c[8:9])


def test_bfloat16_stays_near_float32() -> None:
    pair = make_pair("llama", dtype=torch.bfloat16)
    cache = make_cache(pair.loom, BLOCK_SIZE, num_blocks=16, dtype=torch.bfloat16)
    tokens = random_tokens(24, 4)
    logits = run_chunks(pair.loom, cache, [SeqChunk(tokens, 0, 24, list(range(6)))])[0]
    _assert_close(logits, hf_logits(pair.hf, tokens), rtol=5e-2)


def _decode_logits(pair, tokens: list[int], block_size: int, block_ids: list[int], others: list[list[int]]):
    """Prefill tokens[:-1] (next to `others`' prefills), then decode the last token next to their decodes."""
    cache = make_cache(pair.loom, block_size, num_blocks=64)
    free = [b for b in range(64) if b not in block_ids]
    tables = [free[i * 8 : (i + 1) * 8] for i in range(len(others))]
    n = len(tokens)
    first = run_chunks(
        pair.loom,
        cache,
        [SeqChunk(tokens, 0, n - 1, block_ids)] + [SeqChunk(o, 0, len(o) - 1, t) for o, t in zip(others, tables)],
    )
    second = run_chunks(
        pair.loom, cache, [SeqChunk(tokens, n - 1, 1, block_ids)] + [SeqChunk(o, len(o) - 1, 1, t) for o, t in zip(others, tables)]
    )
    return torch.cat([first[0], second[0]])


def test_logits_do_not_depend_on_block_layout_or_neighbours(llama_pair) -> None:
    tokens = random_tokens(15, 5)
    base = _decode_logits(llama_pair, tokens, 4, [0, 1, 2, 3], others=[])
    shuffled = _decode_logits(llama_pair, tokens, 4, [9, 3, 40, 17], others=[random_tokens(9, 6), random_tokens(21, 7)])
    bigger_blocks = _decode_logits(llama_pair, tokens, 8, [5, 2], others=[random_tokens(30, 8)])
    torch.testing.assert_close(shuffled, base, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bigger_blocks, base, rtol=1e-5, atol=1e-5)


def test_load_weights_rejects_missing_tensors(llama_pair) -> None:
    weights = dict(llama_pair.hf.state_dict())
    del weights["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match="only some"):
        make_pair_model(llama_pair).load_weights(weights)


def make_pair_model(pair):
    from loom_shard.models import build_model

    return build_model(pair.config)
