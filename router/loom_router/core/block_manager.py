"""KV block bookkeeping for the router: ref-counted device blocks, the prefix cache, the host swap pool.

The shard holds the bytes; this module only decides which block ids hold which tokens, so
every tensor-parallel shard receives identical block tables.

Layout (block_size 4). Two sequences share a cached system prompt; the full blocks are
hashed as a chain, h(i) = hash(h(i-1), tokens of block i), and verified against the
stored token ids on a hit, so a hash collision is a miss, never wrong KV:

    seq A tokens:  [ s0 s1 s2 s3 | s4 s5 s6 s7 | a0 a1 . . ]
    seq A table:   [     0       |     1       |     2      ]
    seq B tokens:  [ s0 s1 s2 s3 | s4 s5 s6 s7 | b0 . . .   ]
    seq B table:   [     0       |     1       |     3      ]
    ref counts:    block 0: 2, block 1: 2, block 2: 1, block 3: 1

A block whose ref count falls to 0 keeps its hash and sits in the cached LRU (still a hit
for the next prompt that starts the same way) until the space is needed: never-hashed free
blocks are handed out first, then the least recently freed cached block is evicted.

A hit is capped at (num_tokens - 1) // block_size blocks, so a sequence always computes at
least its last token (the shard samples only after computing): a prompt of 8 tokens cached
in 2 full blocks reuses block 0 and recomputes block 1's tokens into a fresh block.

Only blocks whose KV has been computed are hashed (`cache_full_blocks`, after each step),
so a hit never points at a block still being filled. The chain hashes of full prompt blocks
allocated but not yet computed are "pending" (`is_prefix_pending`): a scheduler can hold back
a prompt that starts the same way until they are computed, and then it hits.

KV groups (a model with sliding-window layers; `loom_proto.step`): a sequence's table then lists
one block per group for each logical block (entry i * groups + g). A sliding group's blocks that
no query can read any more (all before the next query's window) go back to the pool after each
step (`drop_out_of_window`) and read `None` in the table, hashed ones still cached; a prefix hit
then needs every full group's blocks and each sliding group's blocks of the last window only.
Such a table grows with the tokens each step computes (`compute_limit`, `num_compute`) rather
than covering a whole prompt at admission, so a long prefill never holds a whole prompt's
sliding blocks (vLLM's per-step allocation); without sliding groups nothing changes.

    window 8, block_size 4, 2 groups (full, sliding), 14 tokens computed:
    table: [ f0 --  f1 --  f2 s2  f3 s3 ]     the next query (position 14) reads keys 7..14
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from loom_router.core.request import Sequence

HashFn = Callable[[int | None, tuple[int, ...]], int]


def chain_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """The hash of a full block given its parent's; Python's tuple-of-int hash is stable."""
    return hash((parent_hash, token_ids))


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set only while registered in the prefix cache
    parent_hash: int | None = None
    token_ids: tuple[int, ...] = ()
    group: int = 0  # the KV group whose prefix cache holds it (while registered)


class _SeqTokens:
    """A sequence's tokens as a read-only list for slicing, without building prompt + output."""

    __slots__ = ("_seq",)

    def __init__(self, seq: Sequence) -> None:
        self._seq = seq

    def __len__(self) -> int:
        return self._seq.num_tokens

    def __getitem__(self, index: slice) -> list[int]:
        assert isinstance(index, slice) and index.step is None
        return self._seq.token_slice(index.start or 0, len(self) if index.stop is None else index.stop)

    @property
    def hash_root(self) -> int | None:
        return self._seq.hash_root


class RootedTokens(list[int]):
    """Token ids under a hash root: a LoRA adapter's KV (a snapshot of it), outside any sequence."""

    __slots__ = ("hash_root",)

    def __init__(self, token_ids: Iterable[int], hash_root: int | None) -> None:
        super().__init__(token_ids)
        self.hash_root = hash_root


def _root(token_ids: Seq[int]) -> int | None:
    """The parent hash of token_ids' first block: a sequence's adapter's (_SeqTokens) or the one
    RootedTokens carry, else None (the base model)."""
    return token_ids.hash_root if isinstance(token_ids, (_SeqTokens, RootedTokens)) else None


@dataclass(slots=True)
class CachedFill:
    """Blocks reserved by `allocate_cached`: the caller has the shard fill them, then commits.

    block_ids[i] must receive the KV of token_ids[block_indices[i] * block_size:][:block_size].
    """

    token_ids: list[int]
    root: int | None = None  # the parent hash of the first block (an adapter's KV)
    block_ids: list[int] = field(default_factory=list)
    block_indices: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # chain hash of every full block of token_ids


class BlockManager:
    """Device blocks with ref counts and a prefix cache, plus a host pool for swapping.

    Every mutating call has a `can_*` twin; when the check fails the state is unchanged.
    """

    def __init__(self, block_size: int, num_blocks: int, num_host_blocks: int = 0,
                 enable_prefix_caching: bool = True, hash_fn: HashFn = chain_hash,
                 group_windows: Seq[int | None] = (None,)) -> None:
        assert block_size > 0 and num_blocks > 0 and num_host_blocks >= 0 and group_windows
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.group_windows = tuple(group_windows)  # per KV group: its window, None for full attention
        self._hash_fn = hash_fn
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_ids: deque[int] = deque(range(num_blocks))  # never hashed: used first
        self._cached_ids: OrderedDict[int, None] = OrderedDict()  # ref 0 with a hash, LRU first
        self._hash_maps: list[dict[int, int]] = [{} for _ in self.group_windows]  # per group: hash -> block
        self._hash_to_id = self._hash_maps[0]
        self.per_step = any(w is not None for w in self.group_windows)  # tables grow with each step's tokens
        self._pending: dict[int, int] = {}  # chain hash -> device sequences still computing it
        self.host_ref_counts = [0] * num_host_blocks
        self._free_host_ids: deque[int] = deque(range(num_host_blocks))

    # ---- counts ------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: never-used ones plus evictable cached ones."""
        return len(self._free_ids) + len(self._cached_ids)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._free_host_ids)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    def entries_for(self, num_tokens: int) -> int:
        """Block-table entries covering num_tokens: one per group for each logical block."""
        return self.blocks_for(num_tokens) * self.num_groups

    def _first_kept(self, group: int, num_computed: int) -> int:
        """The first logical block a group keeps once num_computed tokens are computed: the one
        holding the next query's first visible key (0 for full attention)."""
        window = self.group_windows[group]
        return 0 if window is None else max(0, num_computed - window + 1) // self.block_size

    def _covered(self, num_tokens: int, num_computed: int, num_compute: int | None) -> int:
        """The tokens a table must cover: all known ones, or with sliding groups those the next
        step computes (num_compute of them after num_computed)."""
        if not self.per_step or num_compute is None:
            return num_tokens
        return min(num_tokens, num_computed + num_compute)

    @staticmethod
    def wire_table(table: Seq[int | None]) -> list[int]:
        """A block table as the shard takes it: dropped entries (never read) as block 0."""
        return [0 if block_id is None else block_id for block_id in table]

    # ---- prefix cache ------------------------------------------------------------------

    def _block_tokens(self, token_ids: Seq[int], index: int) -> tuple[int, ...]:
        return tuple(token_ids[index * self.block_size:(index + 1) * self.block_size])

    def _lookup(self, parent_hash: int | None, tokens: tuple[int, ...],
                block_hash: int | None = None, group: int = 0) -> tuple[int, int | None]:
        """(hash, id of the group's cached block holding exactly these tokens after this parent);
        block_hash: the hash, when the caller knows it already."""
        if block_hash is None:
            block_hash = self._hash_fn(parent_hash, tokens)
        block_id = self._hash_maps[group].get(block_hash)
        if block_id is not None:
            block = self.blocks[block_id]
            if block.token_ids != tokens or block.parent_hash != parent_hash:
                block_id = None  # a hash collision: treat as a miss
        return block_hash, block_id

    def _find_prefix(self, token_ids: Seq[int], max_blocks: int,
                     known_hashes: Seq[int] = ()) -> tuple[list[int | None], list[int]]:
        """The longest cached prefix of token_ids, in whole blocks: its block-table entries (one per
        group for each block; None where a sliding group no longer needs it) and chain hashes.
        known_hashes: the chain hashes of token_ids' first blocks, if computed already."""
        if not self.enable_prefix_caching:
            return [], []
        if self.group_windows == (None,):
            return self._full_prefix(token_ids, max_blocks, known_hashes)
        hashes = self._chain(token_ids, max_blocks, known_hashes)
        num_hit = self._longest_hit(token_ids, hashes)
        entries = [None if index < self._first_kept(group, num_hit * self.block_size)
                   else self._cached_id(token_ids, hashes, index, group)
                   for index in range(num_hit) for group in range(self.num_groups)]
        return entries, hashes[:num_hit]

    def _full_prefix(self, token_ids: Seq[int], max_blocks: int,
                     known_hashes: Seq[int]) -> tuple[list[int | None], list[int]]:
        """One full-attention group: the cached blocks up to the first the cache lacks."""
        hit_ids: list[int | None] = []
        hashes: list[int] = []
        parent_hash = _root(token_ids)
        for index in range(max_blocks):
            known = known_hashes[index] if index < len(known_hashes) else None
            block_hash, block_id = self._lookup(parent_hash, self._block_tokens(token_ids, index), known)
            if block_id is None:
                break
            hit_ids.append(block_id)
            hashes.append(block_hash)
            parent_hash = block_hash
        return hit_ids, hashes

    def _chain(self, token_ids: Seq[int], num_blocks: int, known_hashes: Seq[int]) -> list[int]:
        """The chain hashes of token_ids' first num_blocks blocks."""
        hashes: list[int] = list(known_hashes[:num_blocks])
        for index in range(len(hashes), num_blocks):
            hashes.append(self._hash_fn(hashes[-1] if hashes else _root(token_ids), self._block_tokens(token_ids, index)))
        return hashes

    def _cached_id(self, token_ids: Seq[int], hashes: list[int], index: int, group: int) -> int | None:
        """The group's cached block holding block `index` of token_ids, or None."""
        parent = hashes[index - 1] if index else _root(token_ids)
        return self._lookup(parent, self._block_tokens(token_ids, index), hashes[index], group)[1]

    def _longest_hit(self, token_ids: Seq[int], hashes: list[int]) -> int:
        """The most leading blocks every group can serve: a full group all of them, a sliding
        group the ones from its first kept block on. O(blocks) lookups."""
        limit = len(hashes)
        for group, window in enumerate(self.group_windows):
            if window is None:
                limit = next((i for i in range(limit) if self._cached_id(token_ids, hashes, i, group) is None), limit)
        last_miss = {}  # sliding group -> per n, the last block before n its cache lacks (-1: none)
        for group, window in enumerate(self.group_windows):
            if window is not None:
                misses, last = [-1], -1
                for i in range(limit):
                    last = i if self._cached_id(token_ids, hashes, i, group) is None else last
                    misses.append(last)
                last_miss[group] = misses
        for num_hit in range(limit, 0, -1):
            if all(misses[num_hit] < self._first_kept(group, num_hit * self.block_size)
                   for group, misses in last_miss.items()):
                return num_hit
        return 0

    def _max_hit_blocks(self, num_tokens: int) -> int:
        return (num_tokens - 1) // self.block_size  # always compute the last token

    def _register(self, block: Block, block_hash: int, parent_hash: int | None,
                  tokens: tuple[int, ...], group: int = 0) -> None:
        """Make a computed full block a cache entry of its group, unless an identical one is already there."""
        if not self.enable_prefix_caching or block.block_hash is not None:
            return
        if block_hash in self._hash_maps[group]:
            return  # a duplicate (or a colliding) block: the first one stays the entry
        block.block_hash, block.parent_hash, block.token_ids, block.group = block_hash, parent_hash, tokens, group
        self._hash_maps[group][block_hash] = block.block_id

    def _register_entries(self, table: Seq[int | None], index: int, block_hash: int, parent_hash: int | None,
                          tokens: tuple[int, ...]) -> None:
        """Register logical block `index` of a table in every group that still holds it."""
        for group in range(self.num_groups):
            block_id = table[index * self.num_groups + group]
            if block_id is not None:
                self._register(self.blocks[block_id], block_hash, parent_hash, tokens, group)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Hash the blocks of seq that became full and computed since the last call."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed // self.block_size, len(seq.block_table) // self.num_groups)
        num_hashed = len(seq.block_hashes)
        parent_hash = seq.block_hashes[-1] if seq.block_hashes else seq.hash_root
        for index in range(num_hashed, num_full):
            start = index * self.block_size
            tokens = tuple(seq.token_slice(start, start + self.block_size))
            block_hash = self._hash_fn(parent_hash, tokens)
            self._register_entries(seq.block_table, index, block_hash, parent_hash, tokens)
            seq.block_hashes.append(block_hash)
            parent_hash = block_hash
        # pending_hashes[0] is the hash of block num_hashed: the computed ones are done.
        num_done = max(0, num_full - num_hashed)
        self._unmark_pending(seq.pending_hashes[:num_done])
        del seq.pending_hashes[:num_done]

    # ---- pending prefixes (allocated, not yet computed) -------------------------------

    def is_prefix_pending(self, token_ids: Seq[int] | Sequence) -> bool:
        """Is the first full block of token_ids (or a sequence's tokens) that the cache lacks
        being computed now?

        Then admitting token_ids after that block is computed turns its prefill into a hit.
        O(1) while nothing is pending, else O(blocks of token_ids).
        """
        if not self._pending:
            return False
        token_ids, known = self._tokens_and_hashes(token_ids)
        max_blocks = self._max_hit_blocks(len(token_ids))
        _, hashes = self._find_prefix(token_ids, max_blocks, known)
        index = len(hashes)
        if index >= max_blocks:
            return False
        if index < len(known):
            return known[index] in self._pending
        parent_hash = hashes[-1] if hashes else _root(token_ids)
        return self._hash_fn(parent_hash, self._block_tokens(token_ids, index)) in self._pending

    def _tokens_and_hashes(self, tokens: Seq[int] | Sequence) -> tuple[Seq[int], Seq[int]]:
        """A sequence's tokens (as a view) with its cached block hashes; plain ids as they are."""
        if isinstance(tokens, Sequence):
            return _SeqTokens(tokens), self.token_block_hashes(tokens)
        return tokens, ()

    def token_block_hashes(self, seq: Sequence) -> list[int]:
        """The chain hashes of seq's full blocks, computing only those not cached on seq yet."""
        cache = seq.token_block_hashes
        num_full = seq.num_tokens // self.block_size
        if len(cache) < num_full and self.enable_prefix_caching:
            tokens = _SeqTokens(seq)
            parent_hash = cache[-1] if cache else seq.hash_root
            for index in range(len(cache), num_full):
                parent_hash = self._hash_fn(parent_hash, self._block_tokens(tokens, index))
                cache.append(parent_hash)
        return cache

    @property
    def num_pending_hashes(self) -> int:
        return len(self._pending)

    def _mark_pending(self, seq: Sequence) -> None:
        """Record the hashes of seq's full prompt blocks after its computed (hashed) ones."""
        assert not seq.pending_hashes, f"seq {seq.seq_id} already has pending blocks"
        if not self.enable_prefix_caching:
            return
        known = self.token_block_hashes(seq)
        for index in range(len(seq.block_hashes), seq.num_prompt_tokens // self.block_size):
            block_hash = known[index]
            seq.pending_hashes.append(block_hash)
            self._pending[block_hash] = self._pending.get(block_hash, 0) + 1

    def _unmark_pending(self, hashes: Iterable[int]) -> None:
        for block_hash in hashes:
            count = self._pending[block_hash] - 1
            if count:
                self._pending[block_hash] = count
            else:
                del self._pending[block_hash]

    def _drop_pending(self, seq: Sequence) -> None:
        self._unmark_pending(seq.pending_hashes)
        seq.pending_hashes = []

    # ---- device blocks -----------------------------------------------------------------

    def _take_block(self) -> int:
        """A block with ref count 1: a never-hashed one, else evict the LRU cached one."""
        if self._free_ids:
            block_id = self._free_ids.popleft()
        else:
            block_id, _ = self._cached_ids.popitem(last=False)
            self._unhash(self.blocks[block_id])
        self.blocks[block_id].ref_count = 1
        return block_id

    def _share_block(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._cached_ids[block_id]  # a cache hit on a free block revives it
        block.ref_count += 1

    def _release_block(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} freed twice"
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.block_hash is not None:
                self._cached_ids[block_id] = None  # most recently freed: evicted last
            else:
                self._free_ids.append(block_id)

    def num_required_blocks(self, token_ids: Seq[int] | Sequence, use_prefix_cache: bool = True,
                            compute_limit: int | None = None) -> int:
        """Free blocks an allocation of token_ids (or a sequence's tokens) takes (hits on
        in-use blocks are free); compute_limit: tokens its first step computes at most."""
        token_ids, known = self._tokens_and_hashes(token_ids)
        entries: list[int | None] = []
        hashes: list[int] = []
        if use_prefix_cache:
            entries, hashes = self._find_prefix(token_ids, self._max_hit_blocks(len(token_ids)), known)
        num_shared = sum(1 for block_id in entries if block_id is not None and self.blocks[block_id].ref_count > 0)
        num_dropped = entries.count(None)
        covered = self._covered(len(token_ids), len(hashes) * self.block_size, compute_limit)
        return self.entries_for(covered) - num_dropped - num_shared

    def can_allocate(self, seq: Sequence, num_extra_blocks: int = 0,
                     use_prefix_cache: bool = True, compute_limit: int | None = None) -> bool:
        needed = self.num_required_blocks(seq, use_prefix_cache, compute_limit)
        return needed + num_extra_blocks <= self.num_free_blocks

    def allocate(self, seq: Sequence, use_prefix_cache: bool = True, compute_limit: int | None = None) -> int:
        """Give seq blocks for all its tokens (with sliding groups: for those its first step,
        computing at most compute_limit of them, reaches), reusing the longest cached prefix.

        Returns the number of tokens whose KV is already there (set as seq.num_computed).
        """
        assert not seq.block_table, f"seq {seq.seq_id} already holds blocks"
        token_ids, known = self._tokens_and_hashes(seq)
        entries: list[int | None] = []
        hashes: list[int] = []
        if use_prefix_cache:
            entries, hashes = self._find_prefix(token_ids, self._max_hit_blocks(len(token_ids)), known)
        for block_id in entries:
            if block_id is not None:
                self._share_block(block_id)
        covered = self._covered(len(token_ids), len(hashes) * self.block_size, compute_limit)
        new_ids = [self._take_block() for _ in range(self.entries_for(covered) - len(entries))]
        seq.block_table = entries + new_ids
        seq.block_hashes = hashes
        seq.num_computed = len(hashes) * self.block_size
        self._mark_pending(seq)
        return seq.num_computed

    def num_slot_blocks(self, seq: Sequence, ahead: int = 0, num_compute: int | None = None) -> int:
        """Blocks seq needs so its table covers every known token (the next step's writes; with
        sliding groups, the num_compute tokens the next step computes), plus `ahead` tokens
        sampled by a step whose output the router has not seen yet."""
        covered = self._covered(seq.num_tokens, seq.num_computed, num_compute) + ahead
        return max(0, self.entries_for(covered) - len(seq.block_table))

    def needs_ahead(self, seqs: list[Sequence]) -> list[int]:
        """`num_slot_blocks(seq, ahead=1)` of each sequence (0 or less: none), for a step planned
        before the one in flight has answered."""
        if self.per_step:
            return [self.num_slot_blocks(seq, ahead=1) for seq in seqs]
        size = self.block_size  # every decoding sequence, every step: inlined
        return [-(-(len(seq.prompt_ids) + len(seq.output_ids) + 1) // size) - len(seq.block_table) for seq in seqs]

    def can_append_slot(self, seq: Sequence) -> bool:
        return self.num_slot_blocks(seq) <= self.num_free_blocks

    def append_slot(self, seq: Sequence, ahead: int = 0, num_compute: int | None = None) -> list[int]:
        """Grow seq's table as `num_slot_blocks` says; returns the new block ids (usually none, or
        one per KV group)."""
        if not self.per_step:  # every step of every decoding sequence: num_slot_blocks inlined
            num_new = -(-(seq.num_tokens + ahead) // self.block_size) - len(seq.block_table)
        else:
            num_new = self.num_slot_blocks(seq, ahead, num_compute)
        if num_new <= 0:
            return []
        new_ids = [self._take_block() for _ in range(num_new)]
        seq.block_table.extend(new_ids)
        return new_ids

    def drop_out_of_window(self, seq: Sequence) -> int:
        """Give back the blocks of seq's sliding groups that no query can read any more (all
        before the next query's window; computed, so hashed ones stay cached). Returns how many."""
        dropped = 0
        for group in range(self.num_groups):
            first_kept = self._first_kept(group, seq.num_computed)
            for index in range(first_kept - 1, -1, -1):  # newest first: stop at the first dropped
                entry = index * self.num_groups + group
                if entry >= len(seq.block_table) or seq.block_table[entry] is None:
                    break
                self._release_block(seq.block_table[entry])
                seq.block_table[entry] = None
                dropped += 1
        return dropped

    def trim(self, seq: Sequence, num_keep: int) -> None:
        """Give back seq's blocks past its first num_keep entries: those only rejected drafts
        reached (past every computed token, so never hashed; the shard drops the same ones)."""
        for block_id in reversed(seq.block_table[num_keep:]):
            if block_id is not None:
                self._release_block(block_id)
        del seq.block_table[num_keep:]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give child the parent's prompt: shared full blocks, its own block for a partial last one.

        The partial block's KV is copied by the shard when it creates the `Fork` (the one
        place a fork copy happens: only after the forward is the parent's last block filled).
        """
        assert not child.block_table
        num_prompt = parent.num_prompt_tokens
        num_full = num_prompt // self.block_size
        shared = parent.block_table[: num_full * self.num_groups]
        for block_id in shared:
            if block_id is not None:
                self._share_block(block_id)
        child.block_table = list(shared)
        child.block_hashes = list(parent.block_hashes[:num_full])
        if num_prompt % self.block_size:
            child.block_table.extend(self._take_block() for _ in range(self.num_groups))

    def free(self, seq: Sequence) -> None:
        """Drop seq's device and host blocks; hashed ones stay cached, the tail evicted first."""
        for block_id in reversed(seq.block_table):
            if block_id is not None:
                self._release_block(block_id)
        for host_id in seq.host_block_table:
            if host_id is not None:
                self._release_host_block(host_id)
        self._drop_pending(seq)
        seq.block_table, seq.block_hashes, seq.host_block_table = [], [], []

    # ---- host swap pool ----------------------------------------------------------------

    def _release_host_block(self, host_id: int) -> None:
        assert self.host_ref_counts[host_id] > 0
        self.host_ref_counts[host_id] -= 1
        if self.host_ref_counts[host_id] == 0:
            self._free_host_ids.append(host_id)

    def can_swap_out(self, seqs: Iterable[Sequence]) -> bool:
        unique = {block_id for seq in seqs for block_id in seq.block_table if block_id is not None}
        return len(unique) <= self.num_free_host_blocks

    def swap_out(self, seqs: Iterable[Sequence]) -> list[tuple[int, int]]:
        """Move the seqs' blocks to host blocks (blocks they share stay shared there).

        Returns (device block, host block) copies. The seqs keep num_computed; their device
        blocks are released (hashed ones stay cached on the device).
        """
        mapping: dict[int, int] = {}
        for seq in seqs:
            held = [block_id for block_id in seq.block_table if block_id is not None]
            for block_id in held:
                if block_id not in mapping:
                    mapping[block_id] = self._free_host_ids.popleft()
                self.host_ref_counts[mapping[block_id]] += 1
            seq.host_block_table = [None if b is None else mapping[b] for b in seq.block_table]
            for block_id in reversed(held):
                self._release_block(block_id)
            seq.block_table = []
            self._drop_pending(seq)  # off the device: nobody should wait for it
        return list(mapping.items())

    def can_swap_in(self, seqs: Iterable[Sequence]) -> bool:
        """Room for the seqs' host blocks plus the blocks to cover their next step."""
        seqs = list(seqs)
        unique = {host_id for seq in seqs for host_id in seq.host_block_table if host_id is not None}
        growth = sum(max(0, self.entries_for(seq.num_tokens) - len(seq.host_block_table))
                     for seq in seqs)
        return len(unique) + growth <= self.num_free_blocks

    def swap_in(self, seqs: Iterable[Sequence]) -> list[tuple[int, int]]:
        """Bring swapped seqs back into fresh device blocks; returns (host, device) copies.

        Their hashed blocks become cache entries again where the cache lost them meanwhile
        (the shard copies them in before the step's forward, so a hit in the same step is safe).
        """
        mapping: dict[int, int] = {}
        for seq in seqs:
            held = [host_id for host_id in seq.host_block_table if host_id is not None]
            for host_id in held:
                if host_id not in mapping:
                    mapping[host_id] = self._take_block()
                else:
                    self.blocks[mapping[host_id]].ref_count += 1
            seq.block_table = [None if h is None else mapping[h] for h in seq.host_block_table]
            for host_id in held:
                self._release_host_block(host_id)
            seq.host_block_table = []
            self._reregister(seq)  # (a swapped seq mid-prompt marks nothing pending: rare)
        return list(mapping.items())

    def _reregister(self, seq: Sequence) -> None:
        """Register seq's hashed blocks unless the cache still holds equal ones."""
        parent_hash = None
        for index, block_hash in enumerate(seq.block_hashes):
            start = index * self.block_size
            tokens = tuple(seq.token_slice(start, start + self.block_size))
            self._register_entries(seq.block_table, index, block_hash, parent_hash, tokens)
            parent_hash = block_hash

    # ---- filling the cache from outside (snapshot restore; one KV group only) ----------

    def can_allocate_cached(self, token_ids: Seq[int]) -> bool:
        fill = self._plan_fill(token_ids)
        return len(fill.block_indices) <= self.num_free_blocks

    def _plan_fill(self, token_ids: Seq[int]) -> CachedFill:
        fill = CachedFill(list(token_ids), _root(token_ids))
        parent_hash = fill.root
        for index in range(len(token_ids) // self.block_size):
            block_hash, block_id = self._lookup(parent_hash, self._block_tokens(token_ids, index))
            if block_id is None:
                fill.block_indices.append(index)
            fill.hashes.append(block_hash)
            parent_hash = block_hash
        return fill

    def allocate_cached(self, token_ids: Seq[int]) -> CachedFill:
        """Reserve blocks for the full blocks of token_ids the cache lacks (a partial tail is
        ignored). Have the shard fill fill.block_ids, then `commit_cached` or `cancel_cached`.
        """
        assert self.enable_prefix_caching
        fill = self._plan_fill(token_ids)
        fill.block_ids = [self._take_block() for _ in fill.block_indices]
        return fill

    def commit_cached(self, fill: CachedFill) -> None:
        """The shard filled the blocks: make them cache entries (ref 0, most recently used)."""
        for block_id, index in zip(fill.block_ids, fill.block_indices):
            parent_hash = fill.hashes[index - 1] if index > 0 else fill.root
            tokens = self._block_tokens(fill.token_ids, index)
            self._register(self.blocks[block_id], fill.hashes[index], parent_hash, tokens)
            self._release_block(block_id)
        fill.block_ids, fill.block_indices = [], []

    def drop_cached(self, token_ids: Seq[int], keep: Iterable[Seq[int]] = ()) -> int:
        """Forget the cached blocks holding token_ids' full blocks that no sequence uses
        (a deleted snapshot); blocks in use stay, and so do those of the sequences in `keep`
        (the snapshots left). Returns how many were dropped."""
        def full_blocks(ids: Seq[int]) -> list[int | None]:
            return self._find_prefix(ids, len(ids) // self.block_size)[0]

        kept = {block_id for other in keep for block_id in full_blocks(other)}
        dropped = [block_id for block_id in full_blocks(token_ids)
                   if block_id is not None and self.blocks[block_id].ref_count == 0 and block_id not in kept]
        for block_id in dropped:
            del self._cached_ids[block_id]
            self._unhash(self.blocks[block_id])
            self._free_ids.append(block_id)
        return len(dropped)

    def forget(self, block_ids: Iterable[int]) -> None:
        """These blocks' contents are unknown (a failed step may not have written them): they
        leave the prefix cache, so no later prompt reuses them."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.block_hash is None:
                continue
            self._unhash(block)
            if block.ref_count == 0:
                del self._cached_ids[block_id]
                self._free_ids.append(block_id)

    def _unhash(self, block: Block) -> None:
        del self._hash_maps[block.group][block.block_hash]
        block.block_hash, block.parent_hash, block.token_ids, block.group = None, None, (), 0

    def cancel_cached(self, fill: CachedFill) -> None:
        """The fill failed: give the reserved blocks back unhashed."""
        for block_id in fill.block_ids:
            self._release_block(block_id)
        fill.block_ids, fill.block_indices = [], []
