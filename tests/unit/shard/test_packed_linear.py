"""PackedLinear: same outputs as nn.Linear, repacked when the weight changes, swaps only plain linears."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from loom_shard import kernels
from loom_shard.layers import row_invariance
from loom_shard.layers.packed_linear import PackedLinear, pack_linears
from loom_shard.layers.row_invariance import Gemm

GEMMS = [Gemm.ONEDNN, Gemm.ONEDNN_PAIRED, Gemm.ONEDNN_K_CHUNKS, Gemm.LOOM]


@pytest.mark.parametrize("rows", [0, 1, 5, 33])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("gemm", GEMMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_gemm_matches_the_float64_reference(rows: int, bias: bool, gemm: Gemm, dtype: torch.dtype) -> None:
    if gemm is not Gemm.LOOM and not row_invariance.onednn_packs(dtype):
        pytest.skip(f"oneDNN has no {dtype} path on this CPU")
    torch.manual_seed(0)
    linear = nn.Linear(1100, 96, bias=bias).to(dtype)  # K > 1024: two K chunks
    packed = PackedLinear(linear, gemm=gemm)
    x = torch.randn(rows, 1100, dtype=dtype)
    with torch.inference_mode():
        out = packed(x)
        reference = F.linear(x.double(), linear.weight.double(), None if linear.bias is None else linear.bias.double())
    assert out.shape == (rows, 96) and out.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), reference, atol=tolerance, rtol=tolerance)
    assert packed._packed is not None  # the packed path ran


@pytest.mark.parametrize("shape", [(1100,), (1, 1100), (1, 1, 1100)])
def test_a_single_row_runs_as_the_first_row_of_a_pair(shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    """ONEDNN_PAIRED never calls oneDNN with one row, whatever the input's leading dimensions."""
    if not row_invariance.onednn_packs(torch.float32):
        pytest.skip("oneDNN has no float32 path on this CPU")
    torch.manual_seed(0)
    packed = PackedLinear(nn.Linear(1100, 96), gemm=Gemm.ONEDNN_PAIRED)
    x = torch.randn(shape)
    rows_seen = []
    linear_pointwise = torch.ops.mkldnn._linear_pointwise

    def spy(x: torch.Tensor, *args: object) -> torch.Tensor:
        rows_seen.append(x.shape[0])
        return linear_pointwise(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    with torch.inference_mode():
        out = packed(x)
        pair = packed(torch.stack([x.reshape(1100)] * 2))
    assert rows_seen == [2, 2] and out.shape == (*shape[:-1], 96)
    assert torch.equal(out.reshape(96), pair[0])


def test_repacks_after_weight_changes() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48, bias=False)).to(torch.bfloat16)
    pack_linears(model)
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    before = model(x)
    with torch.no_grad():
        model[0].weight.mul_(2)  # in place: the version counter moves
    assert torch.equal(model(x), before * 2)
    model.load_state_dict({"0.weight": torch.ones(48, 32)})
    assert torch.equal(model(x), x.sum(-1, keepdim=True).expand(3, 48))
    model.float()  # new storage and dtype: packed again, for float32
    assert torch.equal(model(x.float()), F.linear(x.float(), torch.ones(48, 32)))  # exact: sums of small integers


class _Subclass(nn.Linear):
    pass


def test_pack_linears_swaps_plain_linears_and_keeps_tying() -> None:
    embed = nn.Embedding(10, 8)
    head = nn.Linear(8, 10, bias=False)
    head.weight = embed.weight
    model = nn.ModuleDict({"embed": embed, "head": head, "inner": nn.Sequential(nn.Linear(8, 8), _Subclass(8, 8))})
    assert pack_linears(model) != "none"
    assert isinstance(model["head"], PackedLinear) and isinstance(model["inner"][0], PackedLinear)
    assert type(model["inner"][1]) is _Subclass  # e.g. a tensor-parallel linear with its own forward
    assert model["head"].weight is model["embed"].weight


@pytest.mark.skipif(not kernels.available(), reason="Loom's CPU kernels are not built here")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_loom_kernel_rows_are_bit_identical_at_any_thread_count(dtype: torch.dtype) -> None:
    """Threads split the output columns only: in fixed ranges (9 rows, a decode) or in runs handed
    out as threads ask (70 rows, a prefill); 1, 2 and 3 threads give the same bits."""
    torch.manual_seed(0)
    packed = PackedLinear(nn.Linear(300, 1000).to(dtype), gemm=Gemm.LOOM)
    x = torch.randn(70, 300, generator=torch.Generator().manual_seed(5)).to(dtype)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            with torch.inference_mode():
                results.append([packed(x[:9]), packed(x)])
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for other in results[1:] for a, b in zip(results[0], other))
