"""A projection with LoRA deltas for a mixed batch (Punica/S-LoRA's SGMV): the step's adapter
tokens are grouped by device slot, and each group gets one shrink (x @ A) and one expand (h @ B).

    batch tokens:   t0 t1 t2 t3 t4 t5        slots: t0 base, t1 s2, t2 s0, t3 s2, t4 base, t5 s0
    grouped:        [t2 t5 | t1 t3]          segments: s0 rows 0..2, s2 rows 2..4
    padded (bmm):   slot 0: [t2 t5]  slot 1: [-  -]  slot 2: [t1 t3]   one bmm per factor

When the groups are about even (decode steps) they are padded to one `bmm` over every slot;
otherwise (a long prefill beside short ones) each segment runs its own two matmuls. Base-model
tokens take no LoRA work at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

PAD_WASTE = 2  # pad to one bmm while slots * longest group <= PAD_WASTE * adapter tokens


@dataclass(slots=True)
class LoraBatch:
    """The step's grouping of adapter tokens, built once per step and read by every LoraLinear."""

    token_index: torch.Tensor | None = None  # [num_lora_tokens] batch rows, grouped by slot
    segments: list[tuple[int, int, int]] = field(default_factory=list)  # (slot, start, end) in token_index
    pad_slot: torch.Tensor | None = None  # [num_lora_tokens] slot of each grouped row (padded path)
    pad_pos: torch.Tensor | None = None  # [num_lora_tokens] its row within the slot's group
    max_group: int = 0

    @property
    def active(self) -> bool:
        return self.token_index is not None

    def clear(self) -> None:
        self.token_index = self.pad_slot = self.pad_pos = None
        self.segments = []

    def prepare(self, seq_slots: list[tuple[int | None, int]], num_slots: int, device: torch.device) -> None:
        """seq_slots: per sequence in batch order, (its adapter's slot or None, its tokens this step)."""
        self.clear()
        rows: dict[int, list[int]] = {}
        offset = 0
        for slot, num_tokens in seq_slots:
            if slot is not None:
                rows.setdefault(slot, []).extend(range(offset, offset + num_tokens))
            offset += num_tokens
        if not rows:
            return
        order, slots, positions = [], [], []
        for slot in sorted(rows):
            start = len(order)
            order.extend(rows[slot])
            self.segments.append((slot, start, len(order)))
            slots.extend([slot] * len(rows[slot]))
            positions.extend(range(len(rows[slot])))
        self.token_index = torch.tensor(order, dtype=torch.long, device=device)
        self.max_group = max(len(r) for r in rows.values())
        if num_slots * self.max_group <= PAD_WASTE * len(order):
            self.pad_slot = torch.tensor(slots, dtype=torch.long, device=device)
            self.pad_pos = torch.tensor(positions, dtype=torch.long, device=device)


class LoraLinear(nn.Module):
    """`base(x)` plus, for each adapter token, x @ A[slot] @ B[slot] (scaling folded into B).

    lora_a [num_slots, in, P*R] and lora_b [num_slots, P*R, out] are device slots that
    `loom_shard.lora.slots.LoraSlots` fills; `reduce_shrink`: a row-parallel projection under tensor
    parallelism, whose partial shrinks are summed over the ranks before the expand.
    """

    def __init__(self, base: nn.Module, lora_a: torch.Tensor, lora_b: torch.Tensor, batch: LoraBatch,
                 reduce_shrink: bool) -> None:
        super().__init__()
        self.base = base
        self.register_buffer("lora_a", lora_a, persistent=False)
        self.register_buffer("lora_b", lora_b, persistent=False)
        self.batch = batch
        self.reduce_shrink = reduce_shrink

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        batch = self.batch
        if batch.token_index is None:
            return out
        xs = x.index_select(0, batch.token_index)  # [num_lora_tokens, in]
        delta = self._padded(xs) if batch.pad_slot is not None else self._segmented(xs)
        return out.index_add_(0, batch.token_index, delta.to(out.dtype))

    def _padded(self, xs: torch.Tensor) -> torch.Tensor:
        batch = self.batch
        num_slots = self.lora_a.shape[0]
        padded = xs.new_zeros(num_slots, batch.max_group, xs.shape[1])  # [slots, longest group, in]
        padded[batch.pad_slot, batch.pad_pos] = xs
        shrunk = torch.bmm(padded, self.lora_a)  # [slots, longest group, P*R]
        if self.reduce_shrink:
            dist.all_reduce(shrunk)
        return torch.bmm(shrunk, self.lora_b)[batch.pad_slot, batch.pad_pos]  # [num_lora_tokens, out]

    def _segmented(self, xs: torch.Tensor) -> torch.Tensor:
        segments = self.batch.segments
        shrunk = torch.cat([xs[start:end] @ self.lora_a[slot] for slot, start, end in segments])
        if self.reduce_shrink:
            dist.all_reduce(shrunk)
        return torch.cat([shrunk[start:end] @ self.lora_b[slot] for slot, start, end in segments])


def unwrap(module: nn.Module) -> nn.Module:
    """The base projection of a LoraLinear; any other module as it is."""
    return module.base if isinstance(module, LoraLinear) else module
