"""The Triton paged-attention kernel's layer features: windows, softcaps and sinks against the
float64 reference for query groups from 1 to 32 (one tile per token when a group fills it),
empty sequences (a graph step's unused slots) and the tile table, and rows bit-identical whatever
else is in the step and however a prompt is chunked. On CUDA compiled; with TRITON_INTERPRET=1 on
the CPU, by Triton's interpreter (CI: tests/unit/shard/test_triton_interpreted.py)."""

from __future__ import annotations

import os

import pytest
import torch

from loom_shard.attention.backend import pack_step_tables
from loom_shard.attention.metadata import AttentionSpec, SeqSpan
from tests.unit.shard.test_attention_features import SPANS, _poison_before_windows, _spec, reference
from tests.unit.shard.test_cpu_paged_attention import Cache, make_cache

triton_paged = pytest.importorskip("loom_shard.attention.triton_paged", reason="needs triton")
pytestmark = pytest.mark.interpretable
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


def _attend(q: torch.Tensor, cache: Cache, spans: list[tuple[int, int]], which: list[int],
            spec: AttentionSpec) -> torch.Tensor:
    seq_spans = [SeqSpan(c, n, cache.tables[s]) for s, (c, n) in zip(which, spans)]
    packed, shape = pack_step_tables(seq_spans, cache.kv.shape[2])
    s = shape.num_seqs
    packed = packed.to(DEVICE)
    sinks = spec.sinks.to(DEVICE) if spec.sinks is not None else None
    out = triton_paged.paged_attention_triton(q.to(DEVICE), cache.kv.to(DEVICE), packed[2 * s + 1 :].view(s, shape.max_blocks),
                                              packed[: s + 1], packed[s + 1 : 2 * s + 1], scale=spec.scale,
                                              window=spec.window, softcap=spec.softcap, sinks=sinks)
    return out.cpu()


def _check(out: torch.Tensor, q: torch.Tensor, cache: Cache, spans: list[tuple[int, int]], spec: AttentionSpec) -> None:
    first = 0
    for seq, (cached, n) in enumerate(spans):
        if n:
            expected = reference(q[first : first + n], cache, seq, cached, spec)
            torch.testing.assert_close(out[first : first + n].double(), expected, atol=2e-5, rtol=2e-5)
        first += n


@pytest.mark.parametrize("kind", ["plain", "window", "softcap", "sinks", "all"])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"),
                         [(8, 2, 64, 4), (6, 2, 48, 8), (6, 6, 32, 16), (32, 1, 16, 16)])
def test_kernel_matches_float64_reference(kind: str, heads: int, kv_heads: int,
                                          head_dim: int, block_size: int) -> None:
    spec = AttentionSpec.plain(head_dim) if kind == "plain" else _spec(kind, heads)
    cache = make_cache([c + n for c, n in SPANS], kv_heads, head_dim, block_size, torch.float32)
    if spec.window is not None:
        _poison_before_windows(cache, SPANS, spec.window)
    q = torch.randn(sum(n for _, n in SPANS), heads, head_dim)
    _check(_attend(q, cache, SPANS, list(range(len(SPANS))), spec), q, cache, SPANS, spec)


def test_empty_sequences_and_the_tile_table() -> None:
    """Empty sequences (a graph step's unused slots) get one spare tile each and no rows."""
    spans = [(0, 0), (5, 3), (0, 0), (0, 0), (9, 1), (0, 12), (0, 0)]
    cache = make_cache([max(c + n, 1) for c, n in spans], 3, 32, 4, torch.float32)
    q = torch.randn(16, 9, 32)
    spec = AttentionSpec.plain(32)
    _check(_attend(q, cache, spans, list(range(len(spans))), spec), q, cache, spans, spec)
    # group 3: five tokens a tile; sequence i's first tile is query_starts[i] // 5 + i
    starts = torch.tensor([0, 0, 3, 3, 3, 4, 16, 16], dtype=torch.int32)
    assert triton_paged.tile_seqs(starts.to(DEVICE), 16, group=3).tolist() == [0, 1, 2, 3, 4, 5, 5, 5, 5, 6]


def test_rows_do_not_depend_on_the_batch_or_the_chunking() -> None:
    spec = _spec("all", 6)
    spans = [(150, 1), (20, 50), (90, 1), (3, 30), (200, 1)]
    cache = make_cache([c + n for c, n in spans], 3, 64, 16, torch.float32, seed=4)
    q = torch.randn(sum(n for _, n in spans), 6, 64)
    full = _attend(q, cache, spans, list(range(len(spans))), spec)
    assert torch.equal(_attend(q[:1], cache, spans[:1], [0], spec), full[:1])
    rows, first = [], 20  # sequence 1's 50-token chunk cut in three
    for n in (7, 24, 19):
        rows.append(_attend(q[1 + first - 20 : 1 + first - 20 + n], cache, [(first, n)], [1], spec))
        first += n
    assert torch.equal(torch.cat(rows), full[1:51])
