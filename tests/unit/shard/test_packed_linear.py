"""PackedLinear: same outputs as nn.Linear, repacked when the weight changes, swaps only plain linears."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from loom_shard.layers.packed_linear import PackedLinear, pack_linears

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")


@pytest.mark.parametrize("rows", [0, 1, 5, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_bfloat16_matches_f_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=bias).to(torch.bfloat16)
    packed = PackedLinear(linear)
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(packed(x), F.linear(x, linear.weight, linear.bias))
    assert packed._packed is not None  # the oneDNN path ran


def test_float32_keeps_f_linear_bit_for_bit() -> None:
    linear = nn.Linear(64, 96)
    packed = PackedLinear(linear)
    x = torch.randn(7, 64)
    assert torch.equal(packed(x), linear(x))
    assert packed._packed is None


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
    model.float()  # new storage and dtype: back to F.linear
    assert torch.equal(model(x.float()), F.linear(x.float(), torch.ones(48, 32)))


class _Subclass(nn.Linear):
    pass


def test_pack_linears_swaps_plain_linears_and_keeps_tying() -> None:
    embed = nn.Embedding(10, 8)
    head = nn.Linear(8, 10, bias=False)
    head.weight = embed.weight
    model = nn.ModuleDict({"embed": embed, "head": head, "inner": nn.Sequential(nn.Linear(8, 8), _Subclass(8, 8))})
    assert pack_linears(model) == 2
    assert isinstance(model["head"], PackedLinear) and isinstance(model["inner"][0], PackedLinear)
    assert type(model["inner"][1]) is _Subclass  # e.g. a tensor-parallel linear with its own forward
    assert model["head"].weight is model["embed"].weight
