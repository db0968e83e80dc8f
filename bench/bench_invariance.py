"""Which CPU operations break batch invariance: for each op, 64 random rows are computed
one at a time and then as batches of B rows; the table says at which B some row's result is no
longer bit-identical, and the largest difference seen.

    .venv/bin/python bench/bench_invariance.py

SmolLM2-135M's shapes: hidden 576, intermediate 1536, vocab 49152, 9 heads of 64.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from loom_proto.step import SamplingParams
from loom_shard import kernels
from loom_shard.attention.backend import TorchBackend, select_backend
from loom_shard.attention.metadata import AttentionSpec, SeqSpan
from loom_shard.attention.torch_paged import paged_attention
from loom_shard.layers.packed_linear import PackedLinear
from loom_shard.layers.rotary import RotaryEmbedding
from loom_shard.layers.row_invariance import Gemm
from loom_shard.runtime.sampler import SeqSamplingState, sample

BATCHES = (1, 2, 4, 7, 8, 16, 32, 64)
HIDDEN, INTER, VOCAB = 576, 1536, 49152

Op = Callable[[torch.Tensor], torch.Tensor]  # [rows, in] -> [rows, ...]


def first_break(op: Op, row: torch.Tensor, make_rest: Callable[[int], torch.Tensor]) -> tuple[str, float]:
    """Every row of a batch of B is compared with the same row computed alone (a changed reduction
    order may show in only a few outputs after rounding, so one row is not enough)."""
    batch = torch.cat([row, make_rest(max(BATCHES) - 1)])
    alone = torch.cat([op(batch[i : i + 1]) for i in range(batch.shape[0])])
    worst, broke = 0.0, "never"
    for b in BATCHES[1:]:
        out = op(batch[:b])
        if not torch.equal(out, alone[:b]):
            worst = max(worst, float((out.float() - alone[:b].float()).abs().max()))
            broke = str(b) if broke == "never" else broke
    return broke, worst


def linear_op(k: int, n: int, dtype: torch.dtype, gemm: Gemm | None, packed: bool = True) -> tuple[Op, int]:
    """gemm None with packed: the probe's choice on this CPU; packed False: F.linear."""
    torch.manual_seed(k + n)
    lin = nn.Linear(k, n, bias=False).to(dtype)
    if packed:
        lin = PackedLinear(lin, gemm=gemm)
    return (lambda x: lin(x)), k


def rows(k: int, dtype: torch.dtype) -> Callable[[int], torch.Tensor]:
    return lambda b: torch.randn(b, k).to(dtype)


def sampler_op(x: torch.Tensor) -> torch.Tensor:
    params = SamplingParams(do_sample=True, temperature=0.8, top_p=0.9, top_k=50, seed=7)
    states = [SeqSamplingState(params, [1, 2, 3], 3) for _ in range(x.shape[0])]
    out = sample(x, states)
    return torch.tensor([[s.token_id, s.logprob] for s in out], dtype=torch.float64)


def attention_rows(backend, spans: list[SeqSpan], q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """Attention output [tokens, heads * 64] of spans whose K/V are already in kv (rewritten unchanged)."""
    meta = backend.build_metadata(spans, 16)
    flat = kv.view(2, -1, kv.shape[3], kv.shape[4])
    k, v = flat[0][meta.slot_mapping].clone(), flat[1][meta.slot_mapping].clone()
    return paged_attention(q, k, v, kv, meta, AttentionSpec.plain(q.shape[-1]))


def attention_cases() -> list[str]:
    """Rows of the markdown table for the attention backends: a decode beside longer decodes
    (padding), and a 40-token chunk computed whole or as 16 + 24."""
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 128, 16, 3, 64, generator=gen).to(torch.bfloat16)
    target = SeqSpan(100, 1, list(range(7)))
    q_target = torch.randn(1, 9, 64, generator=gen).to(torch.bfloat16)
    lines = []
    for name, backend in (("torch paths", TorchBackend(torch.device("cpu"))),
                          ("default CPU backend", select_backend(torch.device("cpu"), torch.bfloat16))):
        alone = attention_rows(backend, [target], q_target, kv)
        broke, worst = "never", 0.0
        for b in BATCHES[1:]:
            contexts = [100 + 13 * i for i in range(1, b)]  # longer than the target: it gets padded
            spans = [target] + [SeqSpan(c, 1, list(range(-(-(c + 1) // 16)))) for c in contexts]
            q = torch.cat([q_target, torch.randn(b - 1, 9, 64, generator=gen).to(torch.bfloat16)])
            out = attention_rows(backend, spans, q, kv)[:1]
            if not torch.equal(out, alone):
                worst = max(worst, float((out.float() - alone.float()).abs().max()))
                broke = str(b) if broke == "never" else broke
        lines.append(f"| decode attention bf16, {name} ({backend.kind.value}), longer decodes beside | {broke} | {worst:.3g} |")
        chunk = SeqSpan(300, 40, list(range(22)))
        q = torch.randn(40, 9, 64, generator=gen).to(torch.bfloat16)
        whole = attention_rows(backend, [chunk], q, kv)
        split = torch.cat([attention_rows(backend, [SeqSpan(300, 16, chunk.block_table)], q[:16], kv),
                           attention_rows(backend, [SeqSpan(316, 24, chunk.block_table)], q[16:], kv)])
        same = torch.equal(whole, split)
        diff = 0.0 if same else float((whole.float() - split.float()).abs().max())
        lines.append(f"| prefill attention bf16, {name}, 40 tokens whole vs 16 + 24 | {'never' if same else 'differs'} | {diff:.3g} |")
    return lines


def main() -> None:
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, kernels {kernels.available()}")
    cases: list[tuple[str, Op, Callable[[int], torch.Tensor], torch.Tensor]] = []
    for name, k, n in (("qkv_proj 576->960", HIDDEN, 960), ("gate_up 576->3072", HIDDEN, 2 * INTER),
                       ("o_proj 576->576", HIDDEN, HIDDEN), ("down_proj 1536->576", INTER, HIDDEN),
                       ("lm_head 576->49152", HIDDEN, VOCAB)):
        for dtype, gemm, packed, label in ((torch.bfloat16, Gemm.ONEDNN, True, "bf16 oneDNN packed, one GEMM"),
                                           (torch.bfloat16, None, True, "bf16 PackedLinear (the probe's choice)"),
                                           (torch.float32, None, True, "fp32 PackedLinear (the probe's choice)"),
                                           (torch.bfloat16, None, False, "bf16 F.linear"),
                                           (torch.float32, None, False, "fp32 F.linear")):
            op, _ = linear_op(k, n, dtype, gemm, packed)
            cases.append((f"{name} {label}", op, rows(k, dtype), torch.randn(1, k).to(dtype)))
    logit_rows = rows(VOCAB, torch.float32)
    cases.append(("log_softmax fp32 [B, 49152]", lambda x: x.log_softmax(-1), logit_rows, torch.randn(1, VOCAB)))
    cases.append(("softmax fp32 [B, 49152]", lambda x: x.softmax(-1), logit_rows, torch.randn(1, VOCAB)))
    cases.append(("argmax fp32 [B, 49152]", lambda x: x.argmax(-1, keepdim=True), logit_rows, torch.randn(1, VOCAB)))
    cases.append(("sampler seeded top-k/top-p", sampler_op, logit_rows, torch.randn(1, VOCAB)))
    if kernels.available():
        w = torch.randn(HIDDEN).to(torch.bfloat16)
        cases.append(("rms_norm kernel bf16", lambda x: kernels.rms_norm(x, w, 1e-5), rows(HIDDEN, torch.bfloat16),
                      torch.randn(1, HIDDEN).to(torch.bfloat16)))
    rotary = RotaryEmbedding(64, 100000.0, None)

    def rope(x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[0]) * 0 + 5  # same position for every row
        return rotary.lookup(positions, 5, x.dtype).apply(x.view(x.shape[0], 12, 64).clone()).flatten(1)

    cases.append(("rotary bf16", rope, rows(768, torch.bfloat16), torch.randn(1, 768).to(torch.bfloat16)))
    print("| op | first batch size where some row differs | largest difference |")
    print("|---|---|---|")
    for name, op, rest, row in cases:
        broke, worst = first_break(op, row, rest)
        print(f"| {name} | {broke} | {worst:.3g} |")
    for line in attention_cases():
        print(line)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
