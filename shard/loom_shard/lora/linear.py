"""A projection with LoRA deltas for a mixed batch (Punica/S-LoRA's SGMV): the step's adapter
tokens are grouped by device slot, and each group gets one shrink (x @ A) and one expand (h @ B).

    batch tokens:   t0 t1 t2 t3 t4 t5        slots: t0 base, t1 s2, t2 s0, t3 s2, t4 base, t5 s0
    grouped:        [t2 t5 | t1 t3]          segments: s0 rows 0..2, s2 rows 2..4
    padded (bmm):   slot 0: [t2 t5]  slot 1: [-  -]  slot 2: [t1 t3]   one bmm per factor

On the CPU with Loom's kernels, two C++ ops do it (`loom::lora_shrink`, `loom::lora_expand_`,
kernels/csrc/lora.cpp): they group the tokens by slot themselves, read each factor once per step
in its own dtype (bfloat16 halves the bytes that are a decode step's LoRA cost) and add the
deltas in place. Elsewhere torch does it: when the groups are about even (decode steps) they are
padded to one `bmm` over every slot; otherwise (a long prefill beside short ones) each segment
runs its own two matmuls. Base-model tokens take no LoRA work at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from loom_shard import kernels
from loom_shard.transfers import to_device

PAD_WASTE = 2  # pad to one bmm while slots * longest group <= PAD_WASTE * adapter tokens


@dataclass(slots=True)
class LoraBatch:
    """The step's grouping of adapter tokens, built once per step and read by every LoraLinear.

    Every move of rows is an `index_select` (a row copy) rather than a scatter: the inputs are
    gathered into their groups (with a zero row where a padded group has no token), and each
    token's delta gathered back into batch order (a zero row for base-model tokens), then added.
    """

    num_tokens: int = 0
    token_index: torch.Tensor | None = None  # [num_lora_tokens] batch rows, grouped by slot
    segments: list[tuple[int, int, int]] = field(default_factory=list)  # (slot, start, end) in token_index
    pad_rows: torch.Tensor | None = None  # [slots * longest group] batch row per padded row; num_tokens: none
    max_group: int = 0
    pad_full: bool = False  # every padded row holds a token (even groups): no zero row to add
    delta_rows: torch.Tensor | None = None  # [num_tokens] each token's row of the deltas; the last: zeros
    token_slot: torch.Tensor | None = None  # [num_tokens] each token's slot, -1 for the base model
    slot_ranks: torch.Tensor | None = None  # [num_slots] int64, each slot's adapter's rank (LoraSlots keeps it)
    on_kernels: bool = False  # Loom's CPU kernels apply the factors: they need token_slot and slot_ranks only

    @property
    def active(self) -> bool:
        return self.token_slot is not None

    @property
    def padded(self) -> bool:
        return self.pad_rows is not None

    def clear(self) -> None:
        self.token_index = self.pad_rows = self.delta_rows = self.token_slot = None
        self.segments = []
        self.pad_full = False

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
        self.num_tokens = offset
        self.token_slot = to_device([-1 if slot is None else slot for slot, n in seq_slots for _ in range(n)], device)
        if self.on_kernels:
            return  # the kernels group the tokens themselves
        order: list[int] = []
        for slot in sorted(rows):
            start = len(order)
            order.extend(rows[slot])
            self.segments.append((slot, start, len(order)))
        self.token_index = to_device(order, device)
        self.max_group = longest = max(len(r) for r in rows.values())
        delta_row = [-1] * offset  # -1: a base-model token (the zero row)
        if num_slots * longest <= PAD_WASTE * len(order):
            pad_rows = [offset] * (num_slots * longest)
            for slot, group in rows.items():
                for pos, row in enumerate(group):
                    pad_rows[slot * longest + pos] = row
                    delta_row[row] = slot * longest + pos
            self.pad_rows = to_device(pad_rows, device)
            self.pad_full = offset not in pad_rows
            zero_row = num_slots * longest
        else:
            for grouped, row in enumerate(order):
                delta_row[row] = grouped
            zero_row = len(order)
        self.delta_rows = to_device([zero_row if r < 0 else r for r in delta_row], device)


class LoraLinear(nn.Module):
    """`base(x)` plus, for each adapter token, x @ A[slot].T @ B[slot] (scaling folded into B).

    lora_a [num_slots, P*R, in] and lora_b (one per fused part p: [num_slots, R, out_p]) are device
    slots that `loom_shard.lora.slots.LoraSlots` fills (loom_shard.lora.layout); `reduce_shrink`: a
    row-parallel projection under tensor parallelism, whose partial shrinks are summed over the ranks
    before the expand.
    """

    def __init__(self, base: nn.Module, lora_a: torch.Tensor, lora_b: list[torch.Tensor], batch: LoraBatch,
                 reduce_shrink: bool) -> None:
        super().__init__()
        self.base = base
        self.lora_a = lora_a  # not buffers: made on the model's device, never moved, never saved
        self.lora_b = lora_b
        self.rank = lora_b[0].shape[1]
        self.num_out = sum(b.shape[2] for b in lora_b)
        self.batch = batch
        self.reduce_shrink = reduce_shrink

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        batch = self.batch
        if not batch.active:
            return out
        if batch.on_kernels:
            return self._kernels(x, out)
        deltas = self._padded(x) if batch.padded else self._segmented(x)  # [rows + 1, out], the last zeros
        return out.add_(deltas.index_select(0, batch.delta_rows))

    def _kernels(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        ops = kernels.ops()
        batch = self.batch
        shrunk = ops.lora_shrink(x, self.lora_a, batch.token_slot, batch.slot_ranks, len(self.lora_b))  # [tokens, P*R]
        if self.reduce_shrink:
            dist.all_reduce(shrunk)
        return ops.lora_expand_(out, shrunk, self.lora_b, batch.token_slot, batch.slot_ranks)

    def _padded(self, x: torch.Tensor) -> torch.Tensor:
        batch = self.batch
        num_slots, longest = self.lora_a.shape[0], batch.max_group
        rows = x if batch.pad_full else torch.cat([x, x.new_zeros(1, x.shape[1])])  # [tokens (+ 1), in]
        padded = rows.index_select(0, batch.pad_rows).view(num_slots, longest, x.shape[1])
        shrunk = torch.bmm(padded.to(self.lora_a.dtype), self.lora_a.transpose(1, 2))  # [slots, longest, P*R]
        if self.reduce_shrink:
            dist.all_reduce(shrunk)
        deltas = shrunk.new_empty(num_slots * longest + 1, self.num_out)
        if len(self.lora_b) == 1:
            torch.bmm(shrunk, self.lora_b[0], out=deltas[:-1].view(num_slots, longest, -1))
        else:  # each part's expand reads its own factor; the parts side by side
            r = self.rank
            parts = [torch.bmm(shrunk[:, :, p * r : (p + 1) * r], b) for p, b in enumerate(self.lora_b)]
            torch.cat(parts, dim=2, out=deltas[:-1].view(num_slots, longest, -1))
        deltas[-1].zero_()
        return deltas

    def _segmented(self, x: torch.Tensor) -> torch.Tensor:
        segments = self.batch.segments
        xs = x.index_select(0, self.batch.token_index).to(self.lora_a.dtype)  # [lora tokens, in], grouped
        shrunk = torch.cat([xs[start:end] @ self.lora_a[slot].T for slot, start, end in segments])
        if self.reduce_shrink:
            dist.all_reduce(shrunk)
        deltas = shrunk.new_empty(xs.shape[0] + 1, self.num_out)
        r, column = self.rank, 0
        for p, b in enumerate(self.lora_b):
            width = b.shape[2]
            for slot, start, end in segments:
                deltas[start:end, column : column + width] = shrunk[start:end, p * r : (p + 1) * r] @ b[slot]
            column += width
        deltas[-1].zero_()
        return deltas


def unwrap(module: nn.Module) -> nn.Module:
    """The base projection of a LoraLinear; any other module as it is."""
    return module.base if isinstance(module, LoraLinear) else module
