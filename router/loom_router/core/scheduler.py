"""The router's scheduler: continuous batching with chunked prefill, n-forks and preemption.

Each `schedule()` builds one `StepPlan`: every running decode, then prompt chunks of
prefilling and waiting groups as the step's token budget allows. `update()` folds the
shard's answer back in. All work per step is O(number of running sequences).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass

from loom_proto.step import Fork, NewRequest, Pooling, RunningRequest, SeqOutput, StepPlan, StepResult
from loom_router.core.block_manager import BlockManager
from loom_router.core.request import SeqStatus, Sequence, SequenceGroup
from loom_router.core.speculate import Speculator


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    block_size: int
    num_blocks: int  # device KV blocks the shards hold
    num_host_blocks: int = 0  # host-RAM swap pool; 0 means preemption always recomputes
    max_batch_prefill_tokens: int = 2048  # tokens one step computes (each decode counts 1)
    max_batch_total_tokens: int | None = None  # KV tokens held by all sequences; None: all blocks
    max_num_seqs: int = 256  # running sequences (n choices count n)
    enable_prefix_caching: bool = True
    # KV groups (models with sliding-window layers): each group's window, None for full attention.
    # A logical block of block_size tokens then takes one block per group.
    kv_group_windows: tuple[int | None, ...] = (None,)
    max_loras_per_batch: int = 4  # distinct LoRA adapters among the running groups (one step's)

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.num_blocks <= 0 or self.num_host_blocks < 0:
            raise ValueError("block_size and num_blocks must be positive, num_host_blocks >= 0")
        if self.max_batch_prefill_tokens <= 0 or self.max_num_seqs <= 0:
            raise ValueError("max_batch_prefill_tokens and max_num_seqs must be positive")
        if self.max_batch_total_tokens is not None and self.max_batch_total_tokens < self.block_size:
            raise ValueError("max_batch_total_tokens must hold at least one block")

    @property
    def num_usable_blocks(self) -> int:
        """The global KV pool: all blocks, capped by max_batch_total_tokens (TGI's meaning: tokens
        of every layer, so one block per KV group for each block of tokens)."""
        if self.max_batch_total_tokens is None:
            return self.num_blocks
        return min(self.num_blocks, self.max_batch_total_tokens // self.block_size * len(self.kv_group_windows))


@dataclass(slots=True)
class SchedulerStats:
    """Counters (monotonic) and gauges (refreshed every schedule/update) for Prometheus."""

    prompt_tokens_computed: int = 0
    prompt_tokens_cached: int = 0  # prompt tokens served from the prefix cache at admission
    preemptions_swap: int = 0
    preemptions_recompute: int = 0
    swapped_blocks: int = 0  # blocks copied to or from the host pool
    num_running: int = 0  # groups
    num_waiting: int = 0  # groups, preempted ones included
    blocks_total: int = 0
    blocks_used: int = 0
    blocks_cached: int = 0  # free but still holding a reusable prefix


@dataclass(slots=True)
class _Step:
    """The plan being built and what is left of its token budget."""

    plan: StepPlan
    budget: int
    preempted: bool = False


class Scheduler:
    """Decides every step what runs, where its KV lives, and who is preempted.

    Running groups are kept in arrival order and scheduled oldest first; when blocks run
    out the newest arrival is preempted, never an older one for a newer one, so the oldest
    request always progresses and every request finishes in bounded time under sustained
    pressure. Preempted groups wait at the head of the queue.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.block_manager = BlockManager(config.block_size, config.num_usable_blocks,
                                          config.num_host_blocks, config.enable_prefix_caching,
                                          group_windows=config.kv_group_windows)
        self._waiting: deque[SequenceGroup] = deque()
        self._running: dict[int, SequenceGroup] = {}  # arrival order: the last is the newest
        self._groups: dict[int, SequenceGroup] = {}
        self._seqs: dict[int, Sequence] = {}  # unfinished sequences by id
        self._releases: list[int] = []  # shard state to drop with the next plan
        self.stats = SchedulerStats(blocks_total=config.num_usable_blocks)
        self.speculator: Speculator | None = None  # --speculate: drafts on decodes (the engine sets it)

    # ---- the engine's calls ------------------------------------------------------------

    def add(self, group: SequenceGroup) -> None:
        assert group.group_id not in self._groups, f"group {group.group_id} added twice"
        self._groups[group.group_id] = group
        for seq in group.seqs:
            self._seqs[seq.seq_id] = seq
        group.set_status(SeqStatus.WAITING)
        self._waiting.append(group)
        self._refresh_gauges()

    def abort(self, group_id: int) -> None:
        """Cancel a request: its blocks are free now, its shard state released next plan."""
        group = self._groups.get(group_id)
        if group is None:
            return
        for seq in group.unfinished_seqs():
            self._retire(seq)
        self._drop_group(group)

    def withdraw(self, plan: StepPlan, group_ids: Collection[int]) -> None:
        """Take these groups out of `plan`, which was not sent, and abort them: the rest of the
        plan runs without them. The requests and forks it would have created on the shards
        have no state there to release."""
        seq_ids = {seq.seq_id for group_id in group_ids if (group := self._groups.get(group_id)) is not None
                   for seq in group.seqs}
        for new in plan.new_requests:
            if new.request_id in seq_ids:
                self._not_sent(new.request_id, new.forks)
        for running in plan.running_requests:
            if running.request_id in seq_ids:
                self._not_sent(None, running.forks)
        plan.new_requests = [r for r in plan.new_requests if r.request_id not in seq_ids]
        plan.running_requests = [r for r in plan.running_requests if r.request_id not in seq_ids]
        plan.allowed_token_masks = {seq_id: mask for seq_id, mask in plan.allowed_token_masks.items()
                                    if seq_id not in seq_ids}
        for group_id in group_ids:
            self.abort(group_id)

    def _not_sent(self, request_id: int | None, forks: list[Fork]) -> None:
        for seq_id in [request_id, *(fork.request_id for fork in forks)]:
            seq = self._seqs.get(seq_id) if seq_id is not None else None
            if seq is not None:
                seq.on_shard = False

    def finish(self, seq: Sequence) -> None:
        """The engine saw a stop (eos, length, stop sequence): free seq now."""
        if seq.is_finished:
            return
        self._retire(seq)
        if seq.group.is_finished:
            self._drop_group(seq.group)

    def live_seq(self, seq_id: int) -> Sequence | None:
        """An unfinished sequence by id (None once finished or aborted)."""
        return self._seqs.get(seq_id)

    def num_running_seqs(self) -> int:
        """Sequences of running groups that still compute (O(running))."""
        return sum(group.num_active for group in self._running.values())

    def has_waiting(self) -> bool:
        return bool(self._waiting)

    def take_releases(self) -> list[int]:
        """Shard state to drop, for a plan built outside `schedule()` (the engine's lookahead)."""
        releases, self._releases = self._releases, []
        return releases

    def has_work(self) -> bool:
        return bool(self._running or self._waiting or self._releases)

    def can_ever_fit(self, num_tokens: int, n: int) -> bool:
        """Could a request of num_tokens (prompt + max new) with n choices run alone?

        Conservative: it ignores that the n choices share their prompt blocks.
        """
        blocks = n * self.block_manager.entries_for(num_tokens)  # a prompt holds every group's blocks
        return n <= self.config.max_num_seqs and blocks <= self.config.num_usable_blocks

    def schedule(self) -> StepPlan | None:
        """The next step, or None when there is nothing to run and nothing to release."""
        running = [(group, group.active_seqs()) for group in self._running.values()]
        num_decodes = sum(1 for _, seqs in running for seq in seqs if seq.num_to_compute == 1)
        step = _Step(StepPlan(), self.config.max_batch_prefill_tokens - num_decodes)
        self._schedule_running(step, running)
        if self.speculator is not None:  # after every running sequence got its slots: drafts take spare ones
            step.budget -= self.speculator.add_drafts(step.plan.running_requests, self._seqs,
                                                      self.block_manager, step.budget)
        if not step.preempted:  # space just taken from a running group is not for newcomers
            self._schedule_waiting(step)
        plan = step.plan
        plan.released_ids, self._releases = self._releases, []
        self._refresh_gauges()
        if plan.num_requests == 0 and not (plan.released_ids or plan.swap_out or plan.swap_in):
            return None
        return plan

    def admit_waiting(self, plan: StepPlan, num_decodes: int) -> None:
        """Admit waiting groups into `plan`, a step of `num_decodes` decodes planned ahead
        (loom_router.core.lookahead), as schedule() would after them: FIFO, the prefill budget
        left by the decodes, no preemption."""
        self._schedule_waiting(_Step(plan, self.config.max_batch_prefill_tokens - num_decodes))
        self._refresh_gauges()

    def update(self, plan: StepPlan, result: StepResult) -> list[tuple[Sequence, SeqOutput]]:
        """Fold a step's result in: advance computed counts, append sampled tokens, hash
        newly full blocks. Returns every output of a live sequence, in plan order (fork
        children right after their parent); `out.token_id` is None for a prefill chunk.
        """
        outputs = {out.request_id: out for out in result.outputs}
        returned: list[tuple[Sequence, SeqOutput]] = []
        seqs = self._seqs
        for request in plan.new_requests:
            seq = seqs.get(request.request_id)
            if seq is not None:  # else aborted while the step ran
                self._advance(seq, request.num_compute, outputs, returned)
                for fork in request.forks:
                    self._start_child(seq, fork, outputs, returned)
        for running in plan.running_requests:
            seq = seqs.get(running.request_id)
            if seq is None:
                continue
            if running.draft_token_ids:
                self._verify(seq, running, outputs[seq.seq_id], returned)
            elif running.num_compute == 1 and not running.forks and seq.num_computed >= seq.num_prompt_tokens:
                self._decoded(seq, outputs.get(seq.seq_id), returned)
            else:
                self._advance(seq, running.num_compute, outputs, returned)
                for fork in running.forks:
                    self._start_child(seq, fork, outputs, returned)
        self._refresh_gauges()
        return returned

    def _decoded(self, seq: Sequence, out: SeqOutput | None, returned: list[tuple[Sequence, SeqOutput]]) -> None:
        """`_advance` for the common case, a decode of one token (no prompt position, no fork)."""
        seq.num_computed += 1
        if out is not None:
            if out.token_id is not None:
                seq.output_ids.append(out.token_id)
            returned.append((seq, out))
        bm = self.block_manager
        if seq.num_computed // bm.block_size > len(seq.block_hashes):  # a block just filled
            bm.cache_full_blocks(seq)

    # ---- scheduling --------------------------------------------------------------------

    def _num_decodes(self) -> int:
        return sum(1 for group in self._running.values() for seq in group.active_seqs()
                   if seq.num_to_compute == 1)

    def _schedule_running(self, step: _Step, running: list[tuple[SequenceGroup, list[Sequence]]]) -> None:
        """Every running group's next tokens, oldest first (`running`: each group with its
        active sequences, in arrival order)."""
        bm = self.block_manager
        block_size = bm.block_size
        single_group = not bm.per_step
        for group, seqs in running:
            if group.group_id not in self._running:
                continue  # preempted this step to make room for an older group
            if single_group:  # the blocks its next tokens need (num_slot_blocks, inlined: the hot path)
                needed = 0
                for seq in seqs:
                    missing = -(-(len(seq.prompt_ids) + len(seq.output_ids)) // block_size) - len(seq.block_table)
                    if missing > 0:
                        needed += missing
            else:
                needed = sum(bm.num_slot_blocks(seq, num_compute=_chunk(seq, step.budget)) for seq in seqs)
            if needed > bm.num_free_blocks and not self._make_room(group, needed, step):
                continue  # it was the newest: preempted itself
            for seq in seqs:
                self._run_seq(seq, step, prepaid=True)

    def _make_room(self, group: SequenceGroup, needed: int, step: _Step) -> bool:
        """Preempt the newest groups until `needed` blocks are free; False when the group itself
        had to go."""
        bm = self.block_manager
        while needed > bm.num_free_blocks:
            victim = self._running[next(reversed(self._running))]  # the newest arrival
            self._preempt(victim, step)
            if victim is group:
                return False
        return True

    def _schedule_waiting(self, step: _Step) -> None:
        if not self._waiting or step.budget <= 0:
            return
        num_seqs = sum(len(group.unfinished_seqs()) for group in self._running.values())
        adapters = self._running_adapters()
        passed: list[SequenceGroup] = []  # waiting for an adapter slot: later groups may go first
        try:
            self._admit_in_order(step, num_seqs, adapters, passed)
        finally:
            self._waiting.extendleft(reversed(passed))

    def _running_adapters(self) -> set[int]:
        return {group.lora_id for group in self._running.values() if group.lora_id is not None}

    def _admit_in_order(self, step: _Step, num_seqs: int, adapters: set[int], passed: list[SequenceGroup]) -> None:
        """FIFO admission; a group whose adapter would make the running adapters exceed
        max_loras_per_batch is passed over (it keeps its place) while others are admitted."""
        while self._waiting and step.budget > 0:
            group = self._waiting[0]
            lora_id = group.lora_id
            if lora_id is not None and lora_id not in adapters and len(adapters) >= self.config.max_loras_per_batch:
                passed.append(self._waiting.popleft())
                continue
            num_group_seqs = len(group.unfinished_seqs())
            if num_seqs + num_group_seqs > self.config.max_num_seqs:
                break
            if self._waits_for_prefix(group):
                break  # its prefix is being computed: next step it is a hit (FIFO kept)
            admitted = self._swap_in(group, step) if group.swapped else self._admit(group, step)
            if not admitted:
                break  # FIFO: nothing overtakes the head, preempted groups first
            self._waiting.popleft()
            self._add_running(group)
            group.set_status(SeqStatus.RUNNING)
            num_seqs += num_group_seqs
            if lora_id is not None:
                adapters.add(lora_id)

    def _add_running(self, group: SequenceGroup) -> None:
        """Insert in arrival order: a resumed group goes back before newer arrivals (O(running),
        only when it is older than the newest, i.e. after a preemption)."""
        newest = self._running[next(reversed(self._running))] if self._running else None
        self._running[group.group_id] = group
        if newest is not None and _arrival(group) < _arrival(newest):
            self._running = dict(sorted(self._running.items(), key=lambda item: _arrival(item[1])))

    @staticmethod
    def _uses_prefix_cache(group: SequenceGroup) -> bool:
        # Prompt logprobs and mean pooling need every prompt position computed: no prefix hits.
        if group.pooling is Pooling.MEAN:
            return False
        return not (group.prompt_logprobs and group.seqs[0].num_generated == 0)

    def _waits_for_prefix(self, group: SequenceGroup) -> bool:
        """Should the group wait a step because a running sequence is computing the next
        blocks of its prompt? Identical prefixes arriving together are then computed once."""
        if group.swapped or not self._uses_prefix_cache(group):
            return False
        return self.block_manager.is_prefix_pending(group.seqs[0])

    def _admit(self, group: SequenceGroup, step: _Step) -> bool:
        """Allocate a new (or preempted-to-recompute) group, reusing cached prefixes."""
        bm = self.block_manager
        use_cache = self._uses_prefix_cache(group)
        fresh = group.seqs[0].status is SeqStatus.WAITING
        if group.forked and not fresh:  # resuming independent choices
            seqs = group.unfinished_seqs()
            needed = sum(bm.num_required_blocks(seq, use_cache, step.budget) for seq in seqs)
            if needed > bm.num_free_blocks:
                return False
            for seq in seqs:
                bm.allocate(seq, use_cache, step.budget)
        else:  # a prompt to prefill, then fork
            parent = group.seqs[0]
            # Each child takes one block (its copy of the last partial block, or the block
            # of its first decode); the parent's first decode needs one when the prompt
            # fills its blocks exactly.
            extra = (group.n - 1 + (parent.num_tokens % bm.block_size == 0)) * bm.num_groups
            limit = step.budget if group.n == 1 else None  # siblings share the whole prompt's blocks
            if not bm.can_allocate(parent, extra, use_cache, limit):
                return False
            bm.allocate(parent, use_cache, limit)
            for child in group.seqs[1:]:
                bm.fork(parent, child)  # the partial block's copy is the shard's, on the Fork
        if fresh:
            group.num_cached_prompt_tokens = group.seqs[0].num_computed
            self.stats.prompt_tokens_cached += group.num_cached_prompt_tokens
        for seq in group.active_seqs():
            self._run_seq(seq, step, prepaid=False)
        return True

    def _swap_in(self, group: SequenceGroup, step: _Step) -> bool:
        bm = self.block_manager
        holders = group.unfinished_seqs()
        if not bm.can_swap_in(holders):
            return False
        pairs = bm.swap_in(holders)
        step.plan.swap_in.extend(pairs)
        self.stats.swapped_blocks += len(pairs)
        group.swapped = False
        for seq in group.active_seqs():
            self._run_seq(seq, step, prepaid=False)
        return True

    def _run_seq(self, seq: Sequence, step: _Step, prepaid: bool) -> None:
        """Put seq's next chunk (or decode token) in the plan, in full if the shard lacks it."""
        num_to_compute = len(seq.prompt_ids) + len(seq.output_ids) - seq.num_computed
        if num_to_compute == 1:  # a decode (or a prompt's last token) always runs
            num_compute = 1
            if not prepaid:
                step.budget -= 1
        else:
            num_compute = max(0, min(num_to_compute, step.budget))
            step.budget -= num_compute
        if num_compute == 0:
            return  # no budget left this step; it stays where it is
        new_block_ids = self.block_manager.append_slot(seq, num_compute=num_compute)
        forks = [] if seq.group.forked else self._forks(seq, num_compute)
        if seq.on_shard:
            step.plan.running_requests.append(RunningRequest(seq.seq_id, num_compute, new_block_ids, forks))
        else:
            step.plan.new_requests.append(self._new_request(seq, num_compute, forks))
            seq.on_shard = True  # from now on an abort must release it

    def _new_request(self, seq: Sequence, num_compute: int, forks: list[Fork]) -> NewRequest:
        group = seq.group
        return NewRequest(
            request_id=seq.seq_id,
            token_ids=seq.token_ids,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached=seq.num_computed,
            num_compute=num_compute,
            block_table=self.block_manager.wire_table(seq.block_table),
            sampling=seq.sampling,
            prompt_logprobs=group.prompt_logprobs and seq.index == 0 and seq.num_generated == 0,
            forks=forks,
            lora_id=group.lora_id,
            pooling=group.pooling,
        )

    def _forks(self, seq: Sequence, num_compute: int) -> list[Fork]:
        """The siblings to create when this chunk completes the group's prompt."""
        group = seq.group
        if group.forked or seq.num_computed + num_compute < seq.num_tokens:
            return []
        group.forked = True
        forks = []
        for child in group.seqs[1:]:
            forks.append(Fork(child.seq_id, child.sampling, self.block_manager.wire_table(child.block_table)))
            child.on_shard = True
        return forks

    def _preempt(self, group: SequenceGroup, step: _Step) -> None:
        """Move the group to the host pool (or drop its KV to recompute) and requeue it first."""
        bm = self.block_manager
        del self._running[group.group_id]
        holders = group.unfinished_seqs()  # before the fork, the children hold blocks too
        for seq in holders:
            self._release(seq)
        if bm.num_host_blocks > 0 and bm.can_swap_out(holders):
            pairs = bm.swap_out(holders)
            step.plan.swap_out.extend(pairs)
            self.stats.swapped_blocks += len(pairs)
            self.stats.preemptions_swap += 1
            group.swapped = True
        else:
            for seq in holders:
                bm.free(seq)  # its full blocks stay cached: likely hits when it resumes
                seq.num_computed = 0
            self.stats.preemptions_recompute += 1
            group.swapped = False
        group.set_status(SeqStatus.PREEMPTED)
        self._waiting.appendleft(group)
        step.preempted = True

    # ---- a failed step -------------------------------------------------------------------

    def rollback(self, plan: StepPlan) -> tuple[list[int], list[int]]:
        """The shards failed `plan`, maybe half-way (and maybe on some ranks only): undo what a
        later step would trust. Returns (failed group ids, requeued group ids).

        - Its requests' groups are aborted (their KV and shard state are unknown): failed.
        - Groups it swapped out may have host blocks that were never written: they drop
          them and are requeued to recompute from their tokens.
        - Blocks it swapped in may hold garbage: they leave the prefix cache.
        - Its releases may not have run: they are sent again (releasing is idempotent).
        """
        self._releases = list(plan.released_ids) + self._releases
        failed = {seq.group.group_id for request in [*plan.new_requests, *plan.running_requests]
                  if (seq := self._seqs.get(request.request_id)) is not None}
        swapped_in = {device_id for _, device_id in plan.swap_in}
        failed |= {group.group_id for group in self._running.values()
                   if any(b in swapped_in for seq in group.unfinished_seqs() for b in seq.block_table)}
        lost_host_ids = {host_id for _, host_id in plan.swap_out}
        requeued = [group for group in self._waiting if group.swapped and group.group_id not in failed
                    and any(h in lost_host_ids for seq in group.unfinished_seqs() for h in seq.host_block_table)]
        for group in requeued:
            self._drop_to_recompute(group)
        for group_id in failed:
            self.abort(group_id)
        self.block_manager.forget(swapped_in)
        self._refresh_gauges()
        return sorted(failed), [group.group_id for group in requeued]

    def _drop_to_recompute(self, group: SequenceGroup) -> None:
        for seq in group.unfinished_seqs():
            self.block_manager.free(seq)
            seq.num_computed = 0
        group.swapped = False
        self.stats.preemptions_recompute += 1

    # ---- bookkeeping -------------------------------------------------------------------

    def _advance(self, seq: Sequence, num_compute: int, outputs: dict[int, SeqOutput],
                 returned: list[tuple[Sequence, SeqOutput]]) -> None:
        start = seq.num_computed
        self.stats.prompt_tokens_computed += max(0, min(seq.num_prompt_tokens, start + num_compute) - start)
        seq.num_computed = start + num_compute
        out = outputs.get(seq.seq_id)
        if out is not None:
            if seq.index == 0 and seq.group.prompt_logprobs:
                self._dedupe_prompt_logprobs(seq, start, out)
            self._append(seq, out, returned)
        self.block_manager.cache_full_blocks(seq)
        self.block_manager.drop_out_of_window(seq)

    def _verify(self, seq: Sequence, request: RunningRequest, out: SeqOutput,
                returned: list[tuple[Sequence, SeqOutput]]) -> None:
        """A decode that carried drafts: one output per token kept (see loom_router.core.speculate)."""
        assert self.speculator is not None
        if seq.num_computed < seq.num_prompt_tokens:  # it computed a prompt's last token
            self.stats.prompt_tokens_computed += 1
        returned.extend((seq, kept) for kept in self.speculator.verified(seq, request, out, self.block_manager))
        self.block_manager.cache_full_blocks(seq)
        self.block_manager.drop_out_of_window(seq)

    def _start_child(self, parent: Sequence, fork: Fork, outputs: dict[int, SeqOutput],
                     returned: list[tuple[Sequence, SeqOutput]]) -> None:
        child = self._seqs.get(fork.request_id)
        if child is None:
            return
        child.num_computed = parent.num_prompt_tokens
        num_full = parent.num_prompt_tokens // self.block_manager.block_size
        child.block_hashes = parent.block_hashes[:num_full]
        out = outputs.get(child.seq_id)
        if out is not None:
            self._append(child, out, returned)

    @staticmethod
    def _append(seq: Sequence, out: SeqOutput, returned: list[tuple[Sequence, SeqOutput]]) -> None:
        if out.token_id is not None:
            assert seq.num_computed == seq.num_tokens, f"seq {seq.seq_id} sampled mid-prompt"
            seq.output_ids.append(out.token_id)
        returned.append((seq, out))

    @staticmethod
    def _dedupe_prompt_logprobs(seq: Sequence, start: int, out: SeqOutput) -> None:
        """Drop logprobs of prompt positions already returned (a prompt recomputed after a
        preemption), so the engine sees each position 1..L-1 once, in order."""
        group = seq.group
        first = start + 1  # position of out.prompt_logprobs[0]: logits at q score token q + 1
        skip = max(0, group.num_prompt_logprobs_sent + 1 - first)
        if skip:
            out.prompt_logprobs = out.prompt_logprobs[skip:]
            out.prompt_top_tokens = out.prompt_top_tokens[skip:]
        group.num_prompt_logprobs_sent = max(group.num_prompt_logprobs_sent,
                                             first + skip + len(out.prompt_logprobs) - 1)

    def _release(self, seq: Sequence) -> None:
        if seq.on_shard:
            self._releases.append(seq.seq_id)
            seq.on_shard = False

    def _retire(self, seq: Sequence) -> None:
        seq.status = SeqStatus.FINISHED
        self.block_manager.free(seq)
        self._release(seq)
        self._seqs.pop(seq.seq_id, None)
        if self.speculator is not None:
            self.speculator.forget(seq.seq_id)

    def _drop_group(self, group: SequenceGroup) -> None:
        self._groups.pop(group.group_id, None)
        if self._running.pop(group.group_id, None) is None and group in self._waiting:
            self._waiting.remove(group)  # rare (a cancel while queued): O(queue) is fine
        self._refresh_gauges()

    def _refresh_gauges(self) -> None:
        bm = self.block_manager
        self.stats.num_running = len(self._running)
        self.stats.num_waiting = len(self._waiting)
        self.stats.blocks_used = bm.num_used_blocks
        self.stats.blocks_cached = bm.num_cached_blocks


def _chunk(seq: Sequence, budget: int) -> int:
    """What `_run_seq` computes of seq with `budget` tokens left: a decode, or a prompt chunk."""
    return 1 if seq.num_to_compute == 1 else max(0, min(seq.num_to_compute, budget))


def _arrival(group: SequenceGroup) -> tuple[float, int]:
    return group.arrival_time, group.group_id
