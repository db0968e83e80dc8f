"""Every build of Loom's CPU kernels (one per ISA, `loom_shard.kernels`): the builds this CPU runs
compute bit-identical results, each build holds only its own ISA's instructions, and the shard's
choice among them follows the CPU. (Each kernel's own tests run once per build: `kernel_isa`.)"""

from __future__ import annotations

import re
import subprocess

import pytest
import torch

from loom_shard import kernels
from loom_shard.layers.quant_linear import QuantKind
from tests.unit.shard.test_quant_linear import make_source


def _attention_case(head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """A prefill chunk after cached keys and two decodes, K/V in shuffled blocks of 16."""
    gen = torch.Generator().manual_seed(head_dim)
    q_lens, cached = [5, 1, 1], [19, 40, 3]
    kv = torch.randn(2, 12, 16, 2, head_dim, generator=gen).to(dtype)
    tables = torch.tensor([[3, 7, 1, 0], [9, 2, 11, 4], [5, 0, 0, 0]], dtype=torch.int32)
    starts = torch.tensor([0, 5, 6, 7], dtype=torch.int32)
    q = torch.randn(sum(q_lens), 6, head_dim, generator=gen).to(dtype)
    return q, kv, tables, starts, torch.tensor(cached, dtype=torch.int32)


def _every_op(ops: torch._ops._OpNamespace, dtype: torch.dtype) -> list[torch.Tensor]:
    """Every kernel of one build on the same inputs."""
    gen = torch.Generator().manual_seed(3)
    results = []
    for seed, kind in enumerate(QuantKind):
        source, _ = make_source(kind, 200, 160, seed)
        packed, scales = getattr(ops, f"qlinear_repack_{kind.name.lower()}")(source.raw, 160)
        results.append(ops.qlinear(torch.randn(37, 160, generator=gen).to(dtype), packed, scales, 200, None))
    weight, x = torch.randn(200, 160, generator=gen).to(dtype), torch.randn(37, 160, generator=gen).to(dtype)
    results.append(ops.linear(x, ops.linear_repack(weight), 200, torch.randn(200, generator=gen)))
    results.append(ops.rms_norm(torch.randn(9, 576, generator=gen).to(dtype), torch.randn(576, generator=gen).to(dtype), 1e-5))
    results += list(ops.add_rms_norm(*(torch.randn(9, 583, generator=gen).to(dtype) for _ in range(2)),
                                     torch.randn(583, generator=gen).to(dtype), 1e-5))
    results.append(ops.silu_mul((torch.randn(9, 2 * 1003, generator=gen) * 4).to(dtype), 1003))
    table = torch.randn(64, 32, generator=gen)
    results.append(ops.rotary(torch.randn(7, 3, 64, generator=gen).to(dtype), torch.arange(7) * 9, table.cos(), table.sin()))
    results += list(ops.greedy_logprob_terms(torch.randn(5, 1003, generator=gen) * 8))
    token_slot = torch.tensor([1, -1, 0, 1, 1])
    x, a = torch.randn(5, 100, generator=gen).to(dtype), torch.randn(2, 16, 100, generator=gen).to(dtype)
    slot_ranks = torch.tensor([8, 5])
    shrunk = ops.lora_shrink(x, a, token_slot, slot_ranks, 2)
    b_parts = [torch.randn(2, 8, out, generator=gen).to(dtype) for out in (40, 24)]
    results += [shrunk,
                ops.lora_expand_(torch.randn(5, 64, generator=gen).to(dtype), shrunk, b_parts, token_slot, slot_ranks)]
    for head_dim in (32, 64, 96, 128, 256, 48):
        case = _attention_case(head_dim, dtype)
        results.append(ops.paged_attention(*case, head_dim**-0.5))
        # A sliding window, a softcap and sinks (Gemma 2, gpt-oss): the same on every build too.
        sinks = torch.randn(case[0].shape[1], generator=gen)
        results.append(ops.paged_attention(*case, 0.3, 5, 2.0, sinks))
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_build_this_cpu_runs_computes_bit_identical_results(dtype: torch.dtype) -> None:
    """The ISA changes the speed, never a value: every kernel of every build agrees with the others."""
    isas = kernels.runnable_isas()
    if len(isas) < 2:
        pytest.skip(f"this CPU runs only the {isas[0].name if isas else 'no'} build")
    reference = _every_op(kernels.ops_for(isas[0]), dtype)
    assert all(r.isfinite().all() for r in reference)
    for isa in isas[1:]:
        for expected, got in zip(reference, _every_op(kernels.ops_for(isa), dtype)):
            assert torch.equal(expected, got), isa.name


@pytest.mark.parametrize("isa", kernels.ISAS, ids=lambda isa: isa.name)
def test_a_build_uses_only_its_own_instruction_set(isa: kernels.Isa) -> None:
    """Built on this machine, each build still runs on any CPU with its ISA: no AVX-512 (zmm
    registers, mask registers) in the AVX2 build, whatever this build host has."""
    assert not any("march" in flag for flag in kernels.CFLAGS + isa.cflags)
    disassembly = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(kernels.build(isa))],
                                 capture_output=True, text=True, check=True).stdout
    avx512 = re.search(r"%zmm\d|\{%k[1-7]\}|%[xy]mm(1[6-9]|2\d|3[01])\b", disassembly)
    if isa.name == "avx2":
        assert avx512 is None, f"AVX-512 instruction in the avx2 build: {avx512.group(0) if avx512 else ''}"
    else:
        assert avx512 is not None  # the check above can see AVX-512 when it is there
    # bfloat16 dot products: in the avx512 build only (one function compiled for AVX-512 BF16, run
    # where /proc/cpuinfo has avx512_bf16: test_bfloat16_dot_products_only_where_the_cpu_has_them).
    assert ("vdpbf16ps" in disassembly) == (isa.name == "avx512")
    # The attention and qlinear prefetches survive compilation (GCC drops a loop of plain
    # __builtin_prefetch calls): without them a batch-32 decode step spent ~15% more waiting on memory.
    assert disassembly.count("prefetcht1") >= 10


def test_selection_follows_the_cpu_and_refuses_a_build_it_cannot_run() -> None:
    previous = kernels.selection()
    try:
        assert kernels.select("off").isa is None and not kernels.available()
        best = kernels.select("auto")
        assert best.isa == kernels.runnable_isas()[0] and kernels.available()
        assert best.isa.name in best.describe()
        for isa in kernels.ISAS:
            if not kernels.runnable(isa):
                with pytest.raises(RuntimeError, match="cannot run"):
                    kernels.select(isa.name)
        with pytest.raises(ValueError, match="must be one of"):
            kernels.select("sse2")
    finally:
        kernels.select(previous.isa.name if previous.isa else "off")


def test_bfloat16_dot_products_only_where_the_cpu_has_them() -> None:
    """The dot products run only where /proc/cpuinfo has avx512_bf16, on the avx512 build (the
    shard's start line and /info say so); the avx2 build refuses a weight in pairs in one line."""
    avx512, avx2 = kernels.by_name("avx512"), kernels.by_name("avx2")
    previous = kernels.selection()
    try:
        if kernels.runnable(avx2):
            assert "BF16" not in kernels.select("avx2").describe()
            assert not kernels.bf16_dot()
            assert kernels.linear_repack(torch.ones(3, 4, dtype=torch.bfloat16)).dim() == 3
            with pytest.raises(RuntimeError, match="no bfloat16 dot products"):
                kernels.ops_for(avx2).linear_repack_pairs(torch.ones(3, 4, dtype=torch.bfloat16))
        if kernels.runnable(avx512):
            said = kernels.select("avx512").describe()  # the shard's start line and /info
            assert kernels.bf16_dot() == ("avx512_bf16" in kernels.cpu_flags()) == ("BF16 dot products" in said)
    finally:
        kernels.select(previous.isa.name if previous.isa else "off")
