"""CPU bfloat16 linears through oneDNN with the weight reordered once (what inductor's freezing does).

`pack_linears` swaps a model's plain nn.Linear modules after loading; the model file never sees it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PACKED_DTYPES = frozenset({torch.bfloat16})  # float32 keeps F.linear: its numerics are the parity reference


class PackedLinear(nn.Module):
    """A drop-in nn.Linear whose CPU bfloat16 matmul reads a oneDNN-blocked copy of the weight.

    F.linear in bfloat16 re-lays the weight out on every call (measured 2-10x slower per
    projection at 1 and 32 rows; bench/BENCHMARKS.md). The original Parameter is kept
    (tied embeddings, state_dict, .to()), and the packed copy is rebuilt whenever the
    weight's storage, dtype or version changes. Other dtypes and devices use F.linear.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight  # the same Parameter: tying survives the swap
        self.bias = linear.bias
        self._packed: torch.Tensor | None = None
        self._packed_key: tuple[int, torch.dtype, int] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPES or x.dtype != weight.dtype:
            return F.linear(x, weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed_weight(), self.bias, "none", [], "")

    def _packed_weight(self) -> torch.Tensor:
        weight = self.weight
        version = 0 if weight.is_inference() else weight._version  # inference tensors have no counter
        key = (weight.data_ptr(), weight.dtype, version)
        if self._packed is None or key != self._packed_key:
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
            self._packed_key = key
        return self._packed

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: nn.Module) -> int:
    """Replace every plain nn.Linear in `model` by a PackedLinear (subclasses, e.g. tensor-parallel
    ones, are left alone). Returns how many were swapped. A no-op without oneDNN."""
    if not torch.backends.mkldnn.is_available():
        return 0
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))
    return len(swaps)
