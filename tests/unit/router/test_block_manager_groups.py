"""KV groups (a full-attention group and a sliding one, window 8, block_size 4): one block per
group for each logical block, sliding blocks back to the pool once out of the window, prefix hits
that need every full block but only the sliding group's last window."""

from __future__ import annotations

from loom_router.core.block_manager import BlockManager
from tests.unit.router.test_block_manager import make_seq, refs

WINDOWS = (None, 8)  # group 0 full attention, group 1 a window of 8 keys


def test_a_logical_block_takes_one_block_per_group() -> None:
    bm = BlockManager(block_size=4, num_blocks=16, group_windows=WINDOWS)
    seq = make_seq(list(range(10)))
    assert bm.num_required_blocks(seq) == 6 and bm.allocate(seq) == 0
    assert seq.block_table == [0, 1, 2, 3, 4, 5]  # (full, sliding) for blocks 0, 1, 2
    assert bm.entries_for(10) == 6 and bm.num_free_blocks == 10
    seq.output_ids = [1, 2, 3]  # 13 tokens: a fourth logical block
    assert bm.num_slot_blocks(seq) == 2 and bm.append_slot(seq) == [6, 7]


def test_sliding_blocks_out_of_the_window_go_back_hashed_ones_stay_cached() -> None:
    bm = BlockManager(block_size=4, num_blocks=32, group_windows=WINDOWS)
    seq = make_seq(list(range(30)))
    bm.allocate(seq)
    seq.num_computed = 29  # the next query, at position 29, reads keys 22..29: blocks 5, 6, 7
    bm.cache_full_blocks(seq)
    assert bm.drop_out_of_window(seq) == 5
    assert seq.block_table[1::2] == [None] * 5 + [11, 13, 15]
    assert seq.block_table[0::2] == [0, 2, 4, 6, 8, 10, 12, 14]  # the full group keeps all
    assert [refs(bm)[b] for b in (1, 3, 5, 7, 9)] == [0] * 5
    assert bm.num_cached_blocks == 5 and bm.num_free_blocks == 32 - 16 + 5
    assert bm.drop_out_of_window(seq) == 0  # nothing more until it computes further
    seq.output_ids, seq.num_computed = [1, 2, 3, 4], 33
    bm.append_slot(seq)
    assert bm.drop_out_of_window(seq) == 1 and seq.block_table[11] is None


def test_a_hit_needs_every_full_block_and_the_sliding_window_only() -> None:
    bm = BlockManager(block_size=4, num_blocks=64, group_windows=WINDOWS)
    a = make_seq(list(range(30)))
    bm.allocate(a)
    a.num_computed = 29
    bm.cache_full_blocks(a)
    bm.drop_out_of_window(a)
    b = make_seq(list(range(28)) + [99, 98])
    assert bm.allocate(b) == 28  # 7 blocks: the full group's 0..6, the sliding group's 5 and 6
    assert b.block_table[:14] == [0, None, 2, None, 4, None, 6, None, 8, None, 10, 11, 12, 13]
    assert refs(bm)[11] == 2 and refs(bm)[1] == 0  # a dropped block is not revived
    # The sliding block of logical block 6 lost: the longest hit whose window is cached is 6 blocks.
    c = make_seq(list(range(28)) + [97, 96])
    bm.forget([13])
    assert bm.allocate(c) == 24
    assert c.block_table[:12] == [0, None, 2, None, 4, None, 6, None, 8, 9, 10, 11]  # 9: a's dropped block 4


def test_fork_and_swap_keep_dropped_entries_dropped() -> None:
    bm = BlockManager(block_size=4, num_blocks=64, num_host_blocks=32, group_windows=WINDOWS)
    seq = make_seq(list(range(30)))
    bm.allocate(seq)
    seq.num_computed = 29
    bm.cache_full_blocks(seq)
    bm.drop_out_of_window(seq)
    held = [b for b in seq.block_table if b is not None]
    assert bm.can_swap_out([seq])
    pairs = bm.swap_out([seq])
    assert [device for device, _ in pairs] == held  # only the blocks still held travel
    assert seq.host_block_table[1::2][:5] == [None] * 5
    assert bm.can_swap_in([seq])
    back = bm.swap_in([seq])
    assert len(back) == len(held) and seq.block_table[1::2][:5] == [None] * 5
    child = make_seq(list(range(30)))
    child.num_computed = 0
    parent = make_seq(list(range(30)))
    bm.allocate(parent)
    parent.num_computed = 29
    bm.cache_full_blocks(parent)
    bm.drop_out_of_window(parent)
    bm.fork(parent, child)
    assert child.block_table[:14] == parent.block_table[:14]  # the 7 full blocks, dropped ones too
    assert len(child.block_table) == 16 and None not in child.block_table[14:]  # its own last block, per group


def test_with_sliding_groups_a_table_covers_the_tokens_each_step_computes() -> None:
    bm = BlockManager(block_size=4, num_blocks=64, group_windows=WINDOWS)
    seq = make_seq(list(range(40)))
    assert bm.num_required_blocks(seq, compute_limit=8) == 4  # the first chunk: 2 logical blocks
    bm.allocate(seq, compute_limit=8)
    assert seq.block_table == [0, 1, 2, 3]
    seq.num_computed = 8
    bm.drop_out_of_window(seq)  # the next query (8) reads keys 1..8: nothing to drop yet
    assert bm.num_slot_blocks(seq, num_compute=8) == 4 and bm.append_slot(seq, num_compute=8) == [4, 5, 6, 7]
    seq.num_computed = 16
    assert bm.drop_out_of_window(seq) == 2  # keys 9..16: blocks 0 and 1 of the sliding group go
    assert bm.num_used_blocks == 6
    assert bm.num_slot_blocks(seq) == 12  # all known tokens (a decode-sized step would say so)
    assert BlockManager(block_size=4, num_blocks=64).num_required_blocks(seq.token_ids, compute_limit=8) == 10
