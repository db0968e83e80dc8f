"""What a step tells every layer's attention: the sequences' spans (`SeqSpan`), built once per
step into `AttentionMetadata` (positions, each token's KV slot, prefill chunks and one decode
batch, or a paged kernel's tables), per KV group where layers keep their KV in groups
(`GroupedMetadata`); and what differs between layers (`AttentionSpec`).

A token's slot = block_table[pos // block_size] * block_size + pos % block_size.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(slots=True, frozen=True)
class AttentionSpec:
    """One layer's attention: its scale, and what it adds to plain causal attention."""

    scale: float
    window: int | None = None  # keys a query sees, itself included (sliding-window layers)
    softcap: float | None = None  # scores become softcap * tanh(score / softcap) (Gemma 2)
    sinks: torch.Tensor | None = None  # [num_heads] logits joining each softmax, no value (gpt-oss)

    @staticmethod
    def plain(head_dim: int) -> AttentionSpec:
        return AttentionSpec(1.0 / math.sqrt(head_dim))

    @property
    def is_plain_causal(self) -> bool:
        return self.window is None and self.softcap is None and self.sinks is None


@dataclass(slots=True)
class SeqSpan:
    """One sequence's share of a step, as the runner describes it."""

    num_cached: int  # tokens already in its blocks
    num_compute: int  # tokens computed this step, from num_cached on
    block_table: list[int]


@dataclass(slots=True)
class PrefillChunk:
    start: int  # first token index in the flat batch
    end: int
    num_cached: int
    block_ids: torch.Tensor | None  # [num_blocks] to gather from; None: no cached tokens


@dataclass(slots=True)
class DecodeBatch:
    start: int  # first decode token index in the flat batch
    block_ids: torch.Tensor  # [num_decodes, max_blocks], padded with block 0
    mask: torch.Tensor  # [num_decodes, 1, max_blocks * block_size] float32, 0 or -inf (padding)
    context_lens: torch.Tensor  # [num_decodes, 1]: keys each decode sees (a window then cuts the first)


@dataclass(slots=True)
class PagedTables:
    """A paged kernel's view of the step (`loom_shard.attention.backend.PagedBackend`)."""

    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    query_starts: torch.Tensor  # [num_seqs + 1] int32: each sequence's first query token
    num_cached: torch.Tensor  # [num_seqs] int32: keys before its first query
    kernel: PagedKernel
    # What a kernel derives from these tables once a step, at its first layer, for every layer
    # after (the Triton kernel's tile-to-sequence table, by query-group size).
    derived: dict[int, torch.Tensor] = field(default_factory=dict)


# (q [num_tokens, heads, head_dim], kv_layer, tables, spec) -> [num_tokens, heads, head_dim]
PagedKernel = Callable[[torch.Tensor, torch.Tensor, PagedTables, AttentionSpec], torch.Tensor]


@dataclass(slots=True)
class AttentionMetadata:
    positions: torch.Tensor  # [num_tokens]
    max_position: int
    slot_mapping: torch.Tensor  # [num_tokens]
    prefills: list[PrefillChunk]
    decode: DecodeBatch | None
    block_size: int
    paged: PagedTables | None = None  # set: one paged kernel attends in place (prefills, decode unused)

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    def layer(self, index: int) -> tuple[int, AttentionMetadata]:
        """Layer `index`'s slot in the KV cache and its metadata: every layer its own slot."""
        return index, self


@dataclass(slots=True)
class GroupedMetadata:
    """A step's metadata when layers keep their KV in groups (`loom_shard.runtime.kv_groups`): one
    AttentionMetadata per group (its block tables, its slots), the same tokens and positions."""

    groups: list[AttentionMetadata]
    layer_groups: tuple[int, ...]
    layer_slots: tuple[int, ...]

    @property
    def positions(self) -> torch.Tensor:
        return self.groups[0].positions

    @property
    def max_position(self) -> int:
        return self.groups[0].max_position

    @property
    def num_tokens(self) -> int:
        return self.groups[0].num_tokens

    @property
    def paged(self) -> None:
        return None  # no single set of tables: the fused layers path does not apply

    def layer(self, index: int) -> tuple[int, AttentionMetadata]:
        return self.layer_slots[index], self.groups[self.layer_groups[index]]


def build_metadata(spans: list[SeqSpan], block_size: int, device: torch.device) -> AttentionMetadata:
    """Build the step's metadata. Spans with num_compute > 1 must come before decodes (== 1)."""
    positions: list[int] = []
    slots: list[int] = []
    prefills: list[PrefillChunk] = []
    decodes: list[SeqSpan] = []
    for span in spans:
        first, last = span.num_cached, span.num_cached + span.num_compute
        positions.extend(range(first, last))
        table = span.block_table
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(first, last))
        if span.num_compute == 1:
            decodes.append(span)
        else:
            assert not decodes, "prefill chunks must precede decodes"
            start = len(positions) - span.num_compute
            prefills.append(_prefill_chunk(span, start, block_size, device))
    decode_start = len(positions) - len(decodes)
    return AttentionMetadata(
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        max_position=max(positions, default=0),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        prefills=prefills,
        decode=_decode_batch(decodes, decode_start, block_size, device) if decodes else None,
        block_size=block_size,
    )


def _prefill_chunk(span: SeqSpan, start: int, block_size: int, device: torch.device) -> PrefillChunk:
    end = start + span.num_compute
    if span.num_cached == 0:
        return PrefillChunk(start, end, 0, None)
    num_blocks = -(-(span.num_cached + span.num_compute) // block_size)
    block_ids = torch.tensor(span.block_table[:num_blocks], dtype=torch.long, device=device)
    return PrefillChunk(start, end, span.num_cached, block_ids)


def _decode_batch(decodes: list[SeqSpan], start: int, block_size: int, device: torch.device) -> DecodeBatch:
    context_lens = [d.num_cached + 1 for d in decodes]
    max_blocks = -(-max(context_lens) // block_size)
    padded = [d.block_table[: -(-n // block_size)] for d, n in zip(decodes, context_lens)]
    padded = [t + [0] * (max_blocks - len(t)) for t in padded]
    block_ids = torch.tensor(padded, dtype=torch.long, device=device)
    key_pos = torch.arange(max_blocks * block_size, device=device).unsqueeze(0)
    lens = torch.tensor(context_lens, device=device).unsqueeze(1)
    mask = torch.zeros(len(decodes), key_pos.shape[1], device=device).masked_fill(key_pos >= lens, float("-inf"))
    return DecodeBatch(start, block_ids, mask.view(len(decodes), 1, -1), lens)
