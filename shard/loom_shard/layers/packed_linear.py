"""CPU bfloat16 linears through oneDNN with the weight reordered once (what inductor's freezing does).

`pack_linears` swaps a model's plain nn.Linear modules after loading; the model file never sees it.
A row's result never depends on how many rows are in the batch (issue 14): where oneDNN's kernel
for a long reduction would make it so, the weight is packed as K chunks (`row_invariance`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loom_shard.layers import row_invariance

PACKED_DTYPES = frozenset({torch.bfloat16})  # float32 keeps F.linear: its numerics are the parity reference


class PackedLinear(nn.Module):
    """A drop-in nn.Linear whose CPU bfloat16 matmul reads a oneDNN-blocked copy of the weight.

    F.linear in bfloat16 re-lays the weight out on every call (measured 2-10x slower per
    projection at 1 and 32 rows; bench/BENCHMARKS.md). The original Parameter is kept
    (tied embeddings, state_dict, .to()), and the packed copy is rebuilt whenever the
    weight's storage, dtype or version changes. Other dtypes and devices use F.linear.
    """

    def __init__(self, linear: nn.Linear, split_k: bool | None = None) -> None:
        """split_k: pack as K chunks (True), as one GEMM (False), or as the probe of this
        shape on this CPU says (None: `row_invariance.onednn_needs_split`)."""
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight  # the same Parameter: tying survives the swap
        self.bias = linear.bias
        self.split_k = split_k
        self._packed: list[torch.Tensor] | None = None  # one per K chunk, in reduction order
        self._packed_key: tuple[int, torch.dtype, int] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPES or x.dtype != weight.dtype:
            return F.linear(x, weight, self.bias)
        packed = self._packed_weight()
        if len(packed) == 1:
            return torch.ops.mkldnn._linear_pointwise(x, packed[0], self.bias, "none", [], "")
        return self._split_forward(x, packed)

    def _split_forward(self, x: torch.Tensor, packed: list[torch.Tensor]) -> torch.Tensor:
        # Each chunk's GEMM is row-invariant; their sum in a fixed order keeps it so. Two bfloat16
        # parts add in float32 and round once (what torch's bfloat16 add does), so the common
        # two-chunk case needs no float32 buffer; more chunks accumulate in float32.
        parts, start = [], 0
        for width, weight in zip(self._chunk_widths(), packed):  # strided slices: oneDNN reads them in place
            parts.append(torch.ops.mkldnn._linear_pointwise(x[..., start : start + width], weight, None, "none", [], ""))
            start += width
        if len(parts) == 2:
            out = parts[0].add_(parts[1])
        else:
            total = parts[0].float()
            for part in parts[1:]:
                total.add_(part)
            out = total.to(x.dtype)
        return out if self.bias is None else out.add_(self.bias)

    def _chunk_widths(self) -> list[int]:
        split = self.split_k
        if split is None:
            split = row_invariance.onednn_needs_split(self.in_features, self.out_features)
        return row_invariance.k_chunks(self.in_features) if split else [self.in_features]

    def _packed_weight(self) -> list[torch.Tensor]:
        weight = self.weight
        version = 0 if weight.is_inference() else weight._version  # inference tensors have no counter
        key = (weight.data_ptr(), weight.dtype, version)
        if self._packed is None or key != self._packed_key:
            with torch.no_grad():
                chunks = weight.detach().split(self._chunk_widths(), dim=1)
                self._packed = [torch.ops.mkldnn._reorder_linear_weight(c.contiguous(), None) for c in chunks]
            self._packed_key = key
        return self._packed

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"split_k={self.split_k}")


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
