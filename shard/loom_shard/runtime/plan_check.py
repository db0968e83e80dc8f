"""Checks a step plan against the shard's state before the runner mutates anything,
so a bad plan is a clear ValueError and leaves every request and block as it was."""

from __future__ import annotations

from loom_proto.step import NewRequest, RunningRequest, StepPlan
from loom_shard.runtime.kv_cache import PagedKVCache
from loom_shard.runtime.requests import RequestState
from loom_shard.runtime.token_mask import check_mask


class PlanCheck:
    """Validates a plan against the shard's state before anything is mutated."""

    def __init__(self, requests: dict[int, RequestState], kv: PagedKVCache, vocab_size: int,
                 num_groups: int = 1) -> None:
        self.requests = requests
        self.kv = kv
        self.vocab_size = vocab_size
        self.num_groups = num_groups  # KV groups: a block table lists one block per group per logical block

    def validate(self, plan: StepPlan) -> None:
        released = set(plan.released_ids)
        requests = self.requests
        self._pairs("swap_out", plan.swap_out, self.kv.num_blocks, self.kv.num_host_blocks)
        self._pairs("swap_in", plan.swap_in, self.kv.num_host_blocks, self.kv.num_blocks)
        seen: set[int] = set()
        for new in plan.new_requests:
            self._fresh_id(new.request_id, released, seen)
            self._new(new)
            for fork in new.forks:
                self._fresh_id(fork.request_id, released, seen)
                self._blocks(fork.request_id, fork.block_table, len(new.token_ids))
        for running in plan.running_requests:
            if running.request_id not in requests or running.request_id in released:
                raise ValueError(f"request {running.request_id}: unknown to this shard (not running)")
            if running.request_id in seen:
                raise ValueError(f"request {running.request_id}: appears twice in the plan")
            seen.add(running.request_id)
            if running.draft_token_ids and running.request_id in plan.allowed_token_masks:
                raise ValueError("drafts for a constrained request: its mask holds for one position only")
            state = requests[running.request_id]
            self._running(running, state)
            for fork in running.forks:
                self._fresh_id(fork.request_id, released, seen)
                self._blocks(fork.request_id, fork.block_table, len(state.token_ids))
        for request_id, mask in plan.allowed_token_masks.items():
            if request_id not in seen:
                raise ValueError(f"request {request_id}: an allowed-token mask for a request not in the step")
            check_mask(request_id, mask)

    def _fresh_id(self, request_id: int, released: set[int], seen: set[int]) -> None:
        """A new id: no request the shard keeps (one it releases in this plan may be reused) nor
        another of this plan."""
        if (request_id in self.requests and request_id not in released) or request_id in seen:
            raise ValueError(f"request {request_id}: already exists")
        seen.add(request_id)

    def _new(self, new: NewRequest) -> None:
        rid = new.request_id
        if not new.token_ids:
            raise ValueError(f"request {rid}: no tokens")
        if not 0 < new.num_prompt_tokens <= len(new.token_ids):
            raise ValueError(f"request {rid}: num_prompt_tokens {new.num_prompt_tokens} outside 1..{len(new.token_ids)}")
        if min(new.token_ids) < 0 or max(new.token_ids) >= self.vocab_size:
            raise ValueError(f"request {rid}: token id outside the vocabulary of {self.vocab_size}")
        self._compute(rid, new.num_cached, new.num_compute, len(new.token_ids))
        self._blocks(rid, new.block_table, new.num_cached + new.num_compute)

    def _running(self, running: RunningRequest, state: RequestState) -> None:
        rid, drafts, num_compute = running.request_id, running.draft_token_ids, running.num_compute
        if drafts:
            self._drafts(running, state)
        num_computed, new_ids = state.num_computed, running.new_block_ids
        # Every running request, every step: the usual case passes with a few comparisons. The
        # blocks it holds were checked when they came: only the new ones' ids are.
        num_blocks = len(state.block_table) + len(new_ids)
        if (num_compute < 1 or num_computed + num_compute > len(state.token_ids) + len(drafts)
                or num_blocks % self.num_groups
                or num_blocks // self.num_groups * self.kv.block_size < num_computed + num_compute):
            self._compute(rid, num_computed, num_compute, len(state.token_ids) + len(drafts))
            self._table_size(rid, num_blocks, num_computed + num_compute)
        if new_ids:
            self._block_ids(rid, new_ids)

    def _drafts(self, running: RunningRequest, state: RequestState) -> None:
        """Drafts ride only on a plain decode: the last sampled token plus the guesses."""
        rid, drafts = running.request_id, running.draft_token_ids
        if state.num_computed != len(state.token_ids) - 1 or running.num_compute != 1 + len(drafts):
            raise ValueError(f"request {rid}: drafts need a decode step computing 1 + {len(drafts)} tokens")
        if running.forks:
            raise ValueError(f"request {rid}: drafts and forks in one step")
        if min(drafts) < 0 or max(drafts) >= self.vocab_size:
            raise ValueError(f"request {rid}: draft token id outside the vocabulary of {self.vocab_size}")

    @staticmethod
    def _compute(rid: int, num_cached: int, num_compute: int, num_tokens: int) -> None:
        if num_cached < 0 or num_compute < 1 or num_cached + num_compute > num_tokens:
            raise ValueError(
                f"request {rid}: cannot compute {num_compute} tokens after {num_cached} of {num_tokens} known tokens"
            )

    def _blocks(self, rid: int, block_table: list[int], num_tokens: int) -> None:
        self._table_size(rid, len(block_table), num_tokens)
        self._block_ids(rid, block_table)

    def _table_size(self, rid: int, num_blocks: int, num_tokens: int) -> None:
        if num_blocks % self.num_groups:
            raise ValueError(f"request {rid}: {num_blocks} blocks are not whole sets of {self.num_groups} KV groups")
        if num_blocks // self.num_groups * self.kv.block_size < num_tokens:
            raise ValueError(f"request {rid}: {num_blocks} blocks cannot hold {num_tokens} tokens")

    def _block_ids(self, rid: int, block_ids: list[int]) -> None:
        num_blocks = self.kv.num_blocks
        if block_ids and (min(block_ids) < 0 or max(block_ids) >= num_blocks):
            bad = [b for b in block_ids if not 0 <= b < num_blocks]
            raise ValueError(f"request {rid}: block ids {bad} outside 0..{num_blocks - 1}")

    @staticmethod
    def _pairs(name: str, pairs: list[tuple[int, int]], num_src: int, num_dst: int) -> None:
        for src, dst in pairs:
            if not (0 <= src < num_src and 0 <= dst < num_dst):
                raise ValueError(f"{name}: block pair ({src}, {dst}) out of range ({num_src}, {num_dst})")
