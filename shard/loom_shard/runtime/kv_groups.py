"""KV groups: where each layer's KV lives when some layers attend through a sliding window, so that
the blocks a window no longer reads go back to the pool while full-attention layers keep theirs
(vLLM's hybrid allocator).

Layers are split by window into groups of equal size G; a KV block holds G layer slots, so every
group draws from one pool of same-sized blocks. The cache is [G, 2, blocks, block_size, kv_heads,
head_dim]; layer l reads slot `layer_slot[l]` through its group's block table. Gemma 3 1B (4 global
layers, 22 sliding) makes G = 4: one full group and six sliding ones (28 slots for 26 layers):

    full group:     [ b0  b1  b2  ... b511 ]        every block of an 8192-token sequence
    sliding groups: [ --  --  ... b480 .. b511 ]   the last window (512 tokens) of each, x 6

A model whose layers all attend alike has one group of every layer: the cache layout of old.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class KVGroups:
    windows: tuple[int | None, ...]  # per group: its layers' window, None for full attention
    layer_groups: tuple[int, ...]  # per layer: its group
    layer_slots: tuple[int, ...]  # per layer: its slot in a block
    num_slots: int  # layer slots per block (G)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @staticmethod
    def of(layer_windows: tuple[int | None, ...]) -> KVGroups:
        """Groups for layers with these windows (None: full attention): full layers first, then each
        window's layers in order, G of them to a group, G the fewest layers any window has."""
        kinds = sorted(set(layer_windows), key=lambda w: (w is not None, w or 0))
        if len(kinds) == 1:
            n = len(layer_windows)
            return KVGroups((kinds[0],), (0,) * n, tuple(range(n)), n)
        members = {kind: [i for i, w in enumerate(layer_windows) if w == kind] for kind in kinds}
        size = min(len(layers) for layers in members.values())
        windows: list[int | None] = []
        layer_groups, layer_slots = [0] * len(layer_windows), [0] * len(layer_windows)
        for kind in kinds:
            layers = members[kind]
            for start in range(0, len(layers), size):
                for slot, layer in enumerate(layers[start : start + size]):
                    layer_groups[layer], layer_slots[layer] = len(windows), slot
                windows.append(kind)
        return KVGroups(tuple(windows), tuple(layer_groups), tuple(layer_slots), size)

    def table(self, block_table: list[int], group: int) -> list[int]:
        """One group's blocks of an interleaved block table (logical block i of group g at i * groups + g)."""
        return block_table[group :: self.num_groups]
