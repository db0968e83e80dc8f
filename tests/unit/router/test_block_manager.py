"""Block manager: exact block ids, ref counts, prefix hits, LRU eviction, forks and swaps."""

from __future__ import annotations

import itertools

from loom_proto.step import SamplingParams
from loom_router.core.block_manager import BlockManager, RootedTokens
from loom_router.core.request import Sequence, SequenceGroup, lora_hash_root

_ids = itertools.count()


def make_seq(prompt: list[int], output: list[int] | None = None) -> Sequence:
    group_id = next(_ids)
    group = SequenceGroup.create(group_id, prompt, [SamplingParams(seed=0)], first_seq_id=group_id)
    seq = group.seqs[0]
    seq.output_ids = list(output or [])
    return seq


def computed(bm: BlockManager, seq: Sequence) -> Sequence:
    """Pretend the shard computed every token but the last, then hash the full blocks."""
    seq.num_computed = seq.num_tokens - 1
    bm.cache_full_blocks(seq)
    return seq


def refs(bm: BlockManager) -> list[int]:
    return [block.ref_count for block in bm.blocks]


def snapshot(bm: BlockManager) -> tuple:
    return (refs(bm), list(bm._free_ids), list(bm._cached_ids), dict(bm._hash_to_id),
            list(bm.host_ref_counts), list(bm._free_host_ids))


def test_allocate_takes_blocks_in_order():
    bm = BlockManager(block_size=4, num_blocks=8)
    seq = make_seq(list(range(10)))
    assert bm.can_allocate(seq)
    assert bm.allocate(seq) == 0
    assert seq.block_table == [0, 1, 2]
    assert refs(bm) == [1, 1, 1, 0, 0, 0, 0, 0]
    assert bm.num_free_blocks == 5 and bm.num_used_blocks == 3


def test_prefix_hit_shares_full_computed_blocks():
    bm = BlockManager(block_size=4, num_blocks=8)
    a = make_seq(list(range(1, 11)))
    bm.allocate(a)
    computed(bm, a)  # 9 computed tokens: blocks 0 and 1 are full
    b = make_seq(list(range(1, 9)) + [99, 98])
    assert bm.num_required_blocks(b.token_ids) == 1  # hits on in-use blocks cost nothing
    assert bm.allocate(b) == 8
    assert b.block_table == [0, 1, 3]
    assert refs(bm)[:4] == [2, 2, 1, 1]
    assert b.block_hashes == a.block_hashes


def test_uncomputed_blocks_are_not_hits():
    bm = BlockManager(block_size=4, num_blocks=8)
    a = make_seq(list(range(10)))
    bm.allocate(a)  # allocated, but the shard has not computed anything yet
    bm.cache_full_blocks(a)
    b = make_seq(list(range(10)))
    assert bm.allocate(b) == 0
    assert b.block_table == [3, 4, 5]


def test_whole_prompt_cached_recomputes_last_block():
    bm = BlockManager(block_size=4, num_blocks=8)
    a = make_seq(list(range(8)), output=[50])
    bm.allocate(a)
    computed(bm, a)  # both prompt blocks full and hashed
    assert len(a.block_hashes) == 2
    b = make_seq(list(range(8)))
    assert bm.allocate(b) == 4  # capped at (8 - 1) // 4 blocks: the last token is computed
    assert b.block_table == [0, 3]


def test_hash_collision_is_a_miss():
    bm = BlockManager(block_size=4, num_blocks=8, hash_fn=lambda parent, tokens: 42)
    a = make_seq([1, 2, 3, 4, 1, 2, 3, 4, 7])
    bm.allocate(a)
    computed(bm, a)
    assert bm._hash_to_id == {42: 0}  # block 1 collides with block 0: not registered
    other_tokens = make_seq([5, 6, 7, 8, 9])
    assert bm.allocate(other_tokens) == 0
    # Block 1 holds the same tokens as block 0 but after another parent: also a miss.
    same_tokens = make_seq([1, 2, 3, 4, 1, 2, 3, 4, 9])
    assert bm.allocate(same_tokens) == 4
    assert same_tokens.block_table[0] == 0


def test_free_keeps_hashed_blocks_cached_and_evicts_lru_first():
    bm = BlockManager(block_size=4, num_blocks=8)
    a = make_seq(list(range(10)))
    bm.allocate(a)
    computed(bm, a)
    bm.free(a)
    assert refs(bm) == [0] * 8
    assert list(bm._cached_ids) == [1, 0]  # freed tail first, so the tail is evicted first
    assert list(bm._free_ids) == [3, 4, 5, 6, 7, 2]
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 2
    big = make_seq(list(range(100, 125)))  # 7 blocks: the 6 unhashed ones, then evict block 1
    bm.allocate(big)
    assert big.block_table == [3, 4, 5, 6, 7, 2, 1]
    assert list(bm._cached_ids) == [0]
    assert bm.can_allocate(make_seq([1, 2])) and not bm.can_allocate(make_seq(list(range(5))))
    bm.free(big)  # never computed, so nothing of it is cached
    assert list(bm._cached_ids) == [0]
    again = make_seq(list(range(10)))
    assert bm.allocate(again) == 4  # block 0 survived
    assert again.block_table == [0, 1, 2]


def test_cached_hit_counts_against_free_blocks():
    bm = BlockManager(block_size=4, num_blocks=3)
    a = make_seq(list(range(9)))
    bm.allocate(a)
    computed(bm, a)
    bm.free(a)
    b = make_seq(list(range(9)))
    assert bm.num_required_blocks(b.token_ids) == 3  # reviving cached blocks uses them up
    assert bm.can_allocate(b) and not bm.can_allocate(b, num_extra_blocks=1)


def test_failed_checks_leave_state_unchanged():
    bm = BlockManager(block_size=4, num_blocks=8, num_host_blocks=2)
    a = make_seq(list(range(20)))
    bm.allocate(a)
    computed(bm, a)
    before = snapshot(bm)
    big = make_seq(list(range(100, 120)))
    assert not bm.can_allocate(big)
    assert not bm.can_swap_out([a])  # 5 blocks, 2 host blocks
    assert not bm.can_allocate_cached(list(range(200, 224)))
    assert snapshot(bm) == before


def test_append_slot_grows_one_block_at_a_boundary():
    bm = BlockManager(block_size=4, num_blocks=8)
    seq = make_seq(list(range(8)))
    bm.allocate(seq)
    assert bm.num_slot_blocks(seq) == 0 and bm.append_slot(seq) == []
    seq.output_ids.append(5)  # 9 tokens: the next decode writes position 8
    assert bm.can_append_slot(seq)
    assert bm.append_slot(seq) == [2]
    assert seq.block_table == [0, 1, 2]


def test_needs_ahead_is_num_slot_blocks_one_token_ahead_with_and_without_sliding_groups():
    for windows in ((None,), (None, 8)):
        bm = BlockManager(block_size=4, num_blocks=64, group_windows=windows)
        seqs = [make_seq(list(range(n))) for n in (3, 4, 5, 7, 8)]
        for seq in seqs:
            bm.allocate(seq)
        seqs[0].output_ids = [1, 2]  # 5 tokens in a 4-token table: a block short already
        expected = [bm.num_slot_blocks(seq, ahead=1) for seq in seqs]
        assert [max(0, n) for n in bm.needs_ahead(seqs)] == expected, windows
        assert expected == [len(windows) * n for n in (1, 1, 0, 0, 1)]  # one block (per group) at a boundary


def test_fork_shares_full_blocks_and_copies_partial_last():
    bm = BlockManager(block_size=4, num_blocks=8)
    group = SequenceGroup.create(100, list(range(6)), [SamplingParams(seed=s) for s in range(3)],
                                 first_seq_id=100)
    parent, child1, child2 = group.seqs
    bm.allocate(parent)
    bm.fork(parent, child1)
    bm.fork(parent, child2)
    assert child1.block_table == [0, 2] and child2.block_table == [0, 3]  # the shard copies block 1 in
    assert refs(bm)[:4] == [3, 1, 1, 1]
    for seq in group.seqs:
        bm.free(seq)
    assert refs(bm) == [0] * 8 and bm.num_free_blocks == 8


def test_fork_of_block_aligned_prompt_copies_nothing():
    bm = BlockManager(block_size=4, num_blocks=8)
    group = SequenceGroup.create(200, list(range(8)), [SamplingParams(seed=s) for s in range(2)],
                                 first_seq_id=200)
    parent, child = group.seqs
    bm.allocate(parent)
    bm.fork(parent, child)
    assert child.block_table == [0, 1]
    assert refs(bm)[:2] == [2, 2]


def test_swap_out_and_in_keep_sharing():
    bm = BlockManager(block_size=4, num_blocks=8, num_host_blocks=4)
    group = SequenceGroup.create(300, list(range(6)), [SamplingParams(seed=s) for s in range(2)],
                                 first_seq_id=300)
    parent, child = group.seqs
    bm.allocate(parent)
    bm.fork(parent, child)  # parent [0, 1], child [0, 2]
    assert bm.can_swap_out(group.seqs)
    assert bm.swap_out(group.seqs) == [(0, 0), (1, 1), (2, 2)]
    assert parent.host_block_table == [0, 1] and child.host_block_table == [0, 2]
    assert bm.host_ref_counts == [2, 1, 1, 0] and bm.num_free_host_blocks == 1
    assert parent.block_table == [] and bm.num_free_blocks == 8
    assert list(bm._free_ids) == [3, 4, 5, 6, 7, 1, 2, 0]
    assert bm.can_swap_in(group.seqs)
    assert bm.swap_in(group.seqs) == [(0, 3), (1, 4), (2, 5)]
    assert parent.block_table == [3, 4] and child.block_table == [3, 5]
    assert refs(bm)[3:6] == [2, 1, 1]
    assert bm.host_ref_counts == [0, 0, 0, 0] and bm.num_free_host_blocks == 4


def test_swap_in_needs_room_for_next_token():
    bm = BlockManager(block_size=4, num_blocks=2, num_host_blocks=2)
    seq = make_seq(list(range(8)))
    bm.allocate(seq)
    bm.swap_out([seq])
    seq.output_ids.append(1)  # the next decode needs a third block
    assert not bm.can_swap_in([seq])


def test_allocate_cached_then_commit_makes_hits():
    bm = BlockManager(block_size=4, num_blocks=8)
    tokens = list(range(9))
    fill = bm.allocate_cached(tokens)
    assert fill.block_ids == [0, 1] and fill.block_indices == [0, 1]  # the partial tail is left
    assert bm.allocate(make_seq(tokens)) == 0  # not committed: no hits yet
    bm.commit_cached(fill)
    assert bm.num_cached_blocks == 2
    seq = make_seq(tokens + [9])
    assert bm.allocate(seq) == 8
    assert seq.block_table[:2] == [0, 1]
    again = bm.allocate_cached(tokens)  # everything already cached: nothing to fill
    assert again.block_ids == []


def test_cancel_cached_returns_blocks_unhashed():
    bm = BlockManager(block_size=4, num_blocks=8)
    fill = bm.allocate_cached(list(range(8)))
    bm.cancel_cached(fill)
    assert refs(bm) == [0] * 8 and bm.num_cached_blocks == 0 and bm.num_free_blocks == 8
    assert bm.allocate(make_seq(list(range(9)))) == 0


def test_drop_cached_forgets_unused_blocks_and_keeps_used_ones():
    bm = BlockManager(block_size=4, num_blocks=8)
    tokens = list(range(12))
    bm.commit_cached(bm.allocate_cached(tokens))  # blocks 0, 1, 2 cached
    user = make_seq(list(range(4)) + [50, 51])  # still uses block 0
    assert bm.allocate(user) == 4 and user.block_table[0] == 0
    assert bm.drop_cached(tokens + [7]) == 2
    assert refs(bm)[:3] == [1, 0, 0] and bm.num_cached_blocks == 0
    assert bm.allocate(make_seq(tokens + [7])) == 4  # only block 0 still hits
    assert bm.drop_cached([99] * 8) == 0


def make_lora_seq(prompt: list[int], lora_id: int) -> Sequence:
    group_id = next(_ids)
    return SequenceGroup.create(group_id, prompt, [SamplingParams(seed=0)], first_seq_id=group_id,
                                lora_id=lora_id).seqs[0]


def test_cached_fill_under_an_adapters_root_is_hit_by_that_adapter_only():
    """A snapshot of an adapter's KV restored under its hash root: its requests hit the blocks,
    the base model's and another adapter's do not; dropping needs the same root."""
    bm = BlockManager(block_size=4, num_blocks=16)
    tokens = list(range(12))
    bm.commit_cached(bm.allocate_cached(RootedTokens(tokens, lora_hash_root(3))))
    assert bm.num_cached_blocks == 3
    assert bm.allocate(make_seq(tokens + [7])) == 0  # the base model: no cached token
    assert bm.allocate(make_lora_seq(tokens + [7], lora_id=4)) == 0  # another adapter: none either
    hit = make_lora_seq(tokens + [7], lora_id=3)
    assert bm.allocate(hit) == 12 and hit.block_table[:3] == [0, 1, 2]
    bm.free(hit)
    assert bm.drop_cached(tokens) == 0  # the base model's tokens name other blocks
    assert bm.drop_cached(RootedTokens(tokens, lora_hash_root(3)), keep=[RootedTokens(tokens[:4], lora_hash_root(3))]) == 2


def test_pending_prefix_from_allocation_until_computed():
    bm = BlockManager(block_size=4, num_blocks=16)
    a = make_seq(list(range(14)))  # 3 full prompt blocks
    assert not bm.is_prefix_pending(list(range(14)))
    bm.allocate(a)
    assert len(a.pending_hashes) == 3 and bm.num_pending_hashes == 3
    assert bm.is_prefix_pending(list(range(12)) + [99, 98])
    assert bm.is_prefix_pending(list(range(4)) + [99] * 6)  # only the first block shared
    assert not bm.is_prefix_pending([99] + list(range(1, 14)))  # differs in the first block
    assert not bm.is_prefix_pending(list(range(4)))  # its only block is its last: computed anyway
    a.num_computed = 8
    bm.cache_full_blocks(a)  # blocks 0 and 1 are hits now, block 2 still pending
    assert a.pending_hashes == [a_hash_of_block_2(bm)] and bm.num_pending_hashes == 1
    assert bm.is_prefix_pending(list(range(12)) + [99])
    assert not bm.is_prefix_pending(list(range(8)) + [99] * 5)  # its first missing block is not
    a.num_computed = 13
    bm.cache_full_blocks(a)
    assert a.pending_hashes == [] and bm.num_pending_hashes == 0
    assert not bm.is_prefix_pending(list(range(12)) + [99, 98])


def a_hash_of_block_2(bm: BlockManager) -> int:
    h0 = bm._hash_fn(None, (0, 1, 2, 3))
    return bm._hash_fn(bm._hash_fn(h0, (4, 5, 6, 7)), (8, 9, 10, 11))


def test_pending_prefix_dropped_on_free_and_swap_out_and_counted_per_sequence():
    bm = BlockManager(block_size=4, num_blocks=16, num_host_blocks=8)
    a, b = make_seq(list(range(9))), make_seq(list(range(9)))
    bm.allocate(a)
    bm.allocate(b)  # no hits yet: both compute the same blocks
    assert bm.num_pending_hashes == 2
    bm.free(a)
    assert bm.is_prefix_pending(list(range(9)))  # b still computes them
    bm.swap_out([b])
    assert b.pending_hashes == [] and bm.num_pending_hashes == 0
    assert not bm.is_prefix_pending(list(range(9)))


def test_swap_in_reregisters_blocks_the_cache_lost():
    bm = BlockManager(block_size=4, num_blocks=4, num_host_blocks=4)
    a = make_seq(list(range(9)))
    bm.allocate(a)
    computed(bm, a)  # blocks 0, 1 hashed
    bm.swap_out([a])
    assert bm.num_cached_blocks == 2
    filler = make_seq(list(range(100, 116)))  # takes every block: the cached ones are evicted
    bm.allocate(filler)
    assert bm.num_cached_blocks == 0 and bm._hash_to_id == {}
    bm.free(filler)
    bm.swap_in([a])
    assert a.block_table == [0, 1, 2]  # the filler's blocks, freed tail first
    assert sorted(bm._hash_to_id.values()) == [0, 1]
    b = make_seq(list(range(8)) + [50, 51])
    assert bm.allocate(b) == 8 and b.block_table[:2] == [0, 1]


def test_swap_in_keeps_the_cache_entries_that_survived():
    bm = BlockManager(block_size=4, num_blocks=8, num_host_blocks=4)
    a = make_seq(list(range(9)))
    bm.allocate(a)
    computed(bm, a)
    entries = dict(bm._hash_to_id)
    bm.swap_out([a])
    bm.swap_in([a])
    assert bm._hash_to_id == entries  # blocks 0, 1 still cached: the swapped-in copies are not entries
    assert a.block_table == [3, 4, 5]
    assert all(bm.blocks[i].block_hash is None for i in a.block_table)
