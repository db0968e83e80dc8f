"""CPU linears with the weight packed once for the GEMM that runs them (oneDNN's blocked layout, or
Loom's column tiles), the GEMM chosen per shape so that a row's result never depends on the batch
(`row_invariance`). `pack_linears` swaps a model's plain nn.Linear modules after loading; the model
file never sees it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loom_shard import kernels
from loom_shard.layers import row_invariance
from loom_shard.layers.row_invariance import Gemm

PACKED_DTYPES = frozenset({torch.bfloat16, torch.float32})


class PackedLinear(nn.Module):
    """A drop-in nn.Linear whose CPU matmul reads a packed copy of the weight.

    F.linear in bfloat16 re-lays the weight out on every call (measured 2-10x slower per
    projection at 1 and 32 rows; bench/BENCHMARKS.md), and in float32 (MKL) changes a row's
    result with the row count. The original Parameter is kept (tied embeddings, state_dict,
    .to()), and the packed copy is rebuilt whenever the weight's storage, dtype or version
    changes. Other dtypes and devices use F.linear.
    """

    def __init__(self, linear: nn.Linear, gemm: Gemm | None = None) -> None:
        """gemm: the GEMM to run; None: what `row_invariance.choose` finds for this shape here."""
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight  # the same Parameter: tying survives the swap
        self.bias = linear.bias
        self.gemm = gemm
        self._packed: list[torch.Tensor] | None = None  # oneDNN: one per K chunk, in reduction order
        self._packed_key: tuple[int, torch.dtype, int, Gemm] | None = None

    def chosen_gemm(self, dtype: torch.dtype) -> Gemm:
        return self.gemm or row_invariance.choose(self.in_features, self.out_features, dtype)

    def runs_loom_linear(self) -> bool:
        """Whether forward runs loom::linear on inputs of the weight's dtype."""
        weight = self.weight
        return (weight.device.type == "cpu" and weight.dtype in PACKED_DTYPES
                and self.chosen_gemm(weight.dtype) is Gemm.LOOM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPES or x.dtype != weight.dtype:
            return F.linear(x, weight, self.bias)
        gemm = self.chosen_gemm(weight.dtype)
        if gemm is Gemm.TORCH:
            return F.linear(x, weight, self.bias)
        packed = self.packed_weights(gemm)
        if gemm is Gemm.LOOM:
            return kernels.ops().linear(x, packed[0], self.out_features, self.bias)
        if len(packed) > 1:
            return self._split_forward(x, packed)
        if gemm is Gemm.ONEDNN_PAIRED and x.numel() == self.in_features:  # one row: as the first of two
            pair = x.reshape(1, self.in_features).expand(2, self.in_features)
            out = torch.ops.mkldnn._linear_pointwise(pair, packed[0], self.bias, "none", [], "")
            return out[:1].reshape(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, packed[0], self.bias, "none", [], "")

    def _split_forward(self, x: torch.Tensor, packed: list[torch.Tensor]) -> torch.Tensor:
        # Each chunk's GEMM is row-invariant; their sum in a fixed order keeps it so. Two bfloat16
        # parts add in float32 and round once (what torch's bfloat16 add does), so the common
        # two-chunk case needs no float32 buffer; more chunks accumulate in float32.
        parts, start = [], 0
        for width, weight in zip(row_invariance.k_chunks(self.in_features), packed):  # oneDNN reads slices in place
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

    def packed_weights(self, gemm: Gemm) -> list[torch.Tensor]:
        """The weight as `gemm` reads it (oneDNN in K chunks: one per chunk), packed again whenever it changed."""
        weight = self.weight
        version = 0 if weight.is_inference() else weight._version  # inference tensors have no counter
        key = (weight.data_ptr(), weight.dtype, version, gemm)
        if self._packed is None or key != self._packed_key:
            with torch.no_grad():
                w = weight.detach()
                if gemm is Gemm.LOOM:
                    self._packed = [kernels.linear_repack(w)]
                else:
                    widths = row_invariance.k_chunks(self.in_features) if gemm is Gemm.ONEDNN_K_CHUNKS else [self.in_features]
                    self._packed = [torch.ops.mkldnn._reorder_linear_weight(c.contiguous(), None)
                                    for c in w.split(widths, dim=1)]
            self._packed_key = key
        return self._packed

    def extra_repr(self) -> str:
        gemm = self.gemm.value if self.gemm else "chosen per shape"
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, gemm={gemm}"


def pack_linears(model: nn.Module) -> str:
    """Replace every plain nn.Linear in `model` by a PackedLinear (subclasses, e.g. tensor-parallel
    ones, are left alone) and choose each one's GEMM now (probing its shape on this CPU) for the
    dtype the model is in. Returns what runs them, e.g. "oneDNN x90, oneDNN in K chunks x30"."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear]
    counts: dict[str, int] = {}
    for parent, name, child in swaps:
        packed = PackedLinear(child)
        setattr(parent, name, packed)
        dtype = packed.weight.dtype
        if packed.weight.device.type == "cpu" and dtype in PACKED_DTYPES:
            gemm = packed.chosen_gemm(dtype).value
            counts[gemm] = counts.get(gemm, 0) + 1
    return ", ".join(f"{gemm} x{count}" for gemm, count in counts.items()) or "none"
