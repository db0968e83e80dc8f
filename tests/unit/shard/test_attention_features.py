"""What layers add to plain causal attention (a scale, a sliding window, a logit softcap, attention
sinks) in the C++ paged kernel and in the torch paths, against a float64 reference; a window's
rows stay batch- and chunk-invariant, and keys before every window are never read."""

from __future__ import annotations

import pytest
import torch

from loom_shard.attention.backend import pack_step_tables
from loom_shard.attention.metadata import AttentionSpec, SeqSpan, build_metadata
from loom_shard.attention.torch_paged import paged_attention
from loom_shard.kernels.attention import paged_attention as kernel_attention
from tests.unit.shard.test_cpu_paged_attention import Cache, make_cache

pytestmark = pytest.mark.usefixtures("kernel_isa")  # once per build this CPU runs

SPANS = [(0, 23), (17, 40), (31, 1), (32, 1), (0, 1), (70, 1), (5, 3)]  # (num_cached, num_compute)
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _spec(kind: str, heads: int) -> AttentionSpec:
    sinks = torch.linspace(-1.0, 2.0, heads)
    return {"window": AttentionSpec(0.2, window=7),
            "softcap": AttentionSpec(0.4, softcap=3.0),
            "sinks": AttentionSpec(0.15, sinks=sinks),
            "all": AttentionSpec(0.3, window=5, softcap=2.0, sinks=sinks)}[kind]


def reference(q: torch.Tensor, cache: Cache, seq: int, num_cached: int, spec: AttentionSpec) -> torch.Tensor:
    """float64 attention of q [tokens, heads, hd] (positions num_cached..) over seq's keys."""
    tokens, heads, _ = q.shape
    block_size, kv_heads = cache.kv.shape[2], cache.kv.shape[3]
    slots = [(cache.tables[seq][p // block_size], p % block_size) for p in range(num_cached + tokens)]
    kv = torch.stack([cache.kv[:, b, o] for b, o in slots], dim=1).double().nan_to_num()  # poison is never seen
    k = kv[0].repeat_interleave(heads // kv_heads, dim=1)
    v = kv[1].repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("thd,khd->htk", q.double(), k) * spec.scale
    if spec.softcap is not None:
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
    keys = torch.arange(num_cached + tokens)
    positions = (num_cached + torch.arange(tokens))[:, None]
    visible = keys[None, :] <= positions
    if spec.window is not None:
        visible &= keys[None, :] > positions - spec.window
    scores = scores.masked_fill(~visible, float("-inf"))
    if spec.sinks is not None:
        sink = spec.sinks.double().view(heads, 1, 1).expand(heads, tokens, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return torch.einsum("htk,khd->thd", probs, v)


def _poison_before_windows(cache: Cache, spans: list[tuple[int, int]], window: int) -> None:
    """NaN in every key no query of the step can see: a kernel reading one poisons its row."""
    block_size = cache.kv.shape[2]
    for seq, (cached, _) in enumerate(spans):
        for pos in range(max(0, cached + 1 - window)):
            cache.kv[:, cache.tables[seq][pos // block_size], pos % block_size] = float("nan")


def run_kernel(q: torch.Tensor, cache: Cache, spans: list[tuple[int, int]], which: list[int],
               spec: AttentionSpec) -> torch.Tensor:
    seq_spans = [SeqSpan(c, n, cache.tables[s]) for s, (c, n) in zip(which, spans)]
    packed, shape = pack_step_tables(seq_spans, cache.kv.shape[2])
    s = shape.num_seqs
    tables = packed[2 * s + 1 :].view(s, shape.max_blocks)
    return kernel_attention(q, cache.kv, tables, packed[: s + 1], packed[s + 1 : 2 * s + 1], spec.scale,
                            spec.window, spec.softcap, spec.sinks)


def run_torch(q: torch.Tensor, cache: Cache, spans: list[tuple[int, int]], spec: AttentionSpec) -> torch.Tensor:
    """The torch paths (blocked prefill, gathered decode): prefills first, as the runner orders them."""
    seq_spans = [SeqSpan(c, n, cache.tables[s]) for s, (c, n) in enumerate(spans)]
    meta = build_metadata(seq_spans, cache.kv.shape[2], torch.device("cpu"))
    flat = cache.kv.view(2, -1, cache.kv.shape[3], cache.kv.shape[4])
    k, v = flat[0][meta.slot_mapping].clone(), flat[1][meta.slot_mapping].clone()
    return paged_attention(q, k, v, cache.kv, meta, spec).view(q.shape)


@pytest.mark.parametrize("kind", ["window", "softcap", "sinks", "all"])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), [(8, 2, 64, 4), (4, 2, 48, 8), (6, 3, 32, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_float64_reference(kind: str, heads: int, kv_heads: int, head_dim: int, block_size: int,
                                          dtype: torch.dtype) -> None:
    spec = _spec(kind, heads)
    cache = make_cache([c + n for c, n in SPANS], kv_heads, head_dim, block_size, dtype)
    if spec.window is not None:
        _poison_before_windows(cache, SPANS, spec.window)
    q = torch.randn(sum(n for _, n in SPANS), heads, head_dim).to(dtype)
    out = run_kernel(q, cache, SPANS, list(range(len(SPANS))), spec)
    first = 0
    for seq, (cached, n) in enumerate(SPANS):
        expected = reference(q[first : first + n], cache, seq, cached, spec)
        torch.testing.assert_close(out[first : first + n].double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
        first += n


@pytest.mark.parametrize("kind", ["window", "softcap", "sinks", "all"])
def test_torch_paths_match_float64_reference(kind: str) -> None:
    spans = [(0, 23), (17, 40), (5, 3), (31, 1), (32, 1), (0, 1), (70, 1)]  # prefill chunks first
    spec = _spec(kind, 8)
    cache = make_cache([c + n for c, n in spans], 2, 64, 4, torch.float32)
    cache.kv.nan_to_num_()  # the torch decode path reads whole padded blocks
    q = torch.randn(sum(n for _, n in spans), 8, 64)
    out = run_torch(q, cache, spans, spec)
    first = 0
    for seq, (cached, n) in enumerate(spans):
        expected = reference(q[first : first + n], cache, seq, cached, spec)
        torch.testing.assert_close(out[first : first + n].double(), expected, atol=2e-5, rtol=2e-5)
        first += n


@pytest.mark.parametrize("head_dim", [64, 48])
def test_window_rows_are_batch_and_chunk_invariant(head_dim: int) -> None:
    spec = _spec("all", 6)
    spans = [(150, 1), (20, 50), (90, 1), (3, 30), (200, 1)]
    cache = make_cache([c + n for c, n in spans], 3, head_dim, 16, torch.bfloat16, seed=4)
    q = torch.randn(sum(n for _, n in spans), 6, head_dim).to(torch.bfloat16)
    full = run_kernel(q, cache, spans, list(range(len(spans))), spec)
    assert torch.equal(run_kernel(q[:1], cache, spans[:1], [0], spec), full[:1])
    # The 50-token chunk of sequence 1, alone and cut in three: the same rows.
    chunk = q[1:51]
    rows, first = [], 20
    for n in (7, 24, 19):
        rows.append(run_kernel(chunk[first - 20 : first - 20 + n], cache, [(first, n)], [1], spec))
        first += n
    assert torch.equal(torch.cat(rows), full[1:51])
