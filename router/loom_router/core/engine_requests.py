"""The engine's request bookkeeping: what happens to a step's outputs and to finished requests.

`Engine` (loom_router.core.engine) runs the step loop; this base class owns the per-request state
it feeds: grammar matchers, finish decisions (EOS, length, a complete grammar), failing requests,
and the counters the metrics read. A request's tokens go to its sink (its frontend's outbox, or a
consumer inside the core): text, stop strings and streaming are the frontends'. Everything here
runs inside the loop task.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from loom_proto.config import RouterConfig
from loom_proto.step import ModelInfo, SeqOutput, StepPlan, StepResult
from loom_router.contract import Limits, PromptInfo, Submit
from loom_router.core.request import Sequence, SequenceGroup
from loom_router.core.scheduler import Scheduler
from loom_router.structured.grammar import Matcher
from loom_router.tokenizer import Tokenizer
from loom_router.types import EngineStats, FinishReason, GenerationError, StepRecord, status_of

log = logging.getLogger("loom.engine")
CONSTRAINT_FAILED = "the output constraint cannot be enforced (nothing that breaks it was returned)"


class Sink(Protocol):
    """Where a request's tokens and failure go (loom_router.core.outbox.Outbox has this shape)."""

    def token(self, group_id: int, index: int, token_id: int, logprob: float, num_generated: int,
              finish: str | None, top_tokens: list[tuple[int, float]] | None, prompt: PromptInfo | None) -> None: ...

    def fail(self, group_id: int, status: int, message: str) -> None: ...

    def embedding(self, group_id: int, vector: list[float], prompt: PromptInfo) -> None: ...


@dataclass(slots=True)
class _Active:
    group: SequenceGroup
    request: Submit  # its parameters, as the frontend sent them
    sink: Sink
    num_open: int  # choices not finished yet
    arrival: float
    prompt_logprobs: list[float | None]  # filled chunk by chunk when asked for
    hold_blocks: bool = False  # keep the finished sequence's blocks (Engine.held)
    matchers: dict[int, Matcher] = field(default_factory=dict)  # by seq_id, for constrained requests
    scheduled_at: float | None = None  # the first step that ran it (time.monotonic)
    prompt_top_tokens: list[list[tuple[int, float]] | None] = field(default_factory=list)  # with top_n_tokens


class RequestBook:
    """Per-request state and output processing, shared by the engine's loop (its subclass)."""

    config: RouterConfig
    client: object
    tokenizer: Tokenizer
    model_info: ModelInfo | None
    limits: Limits | None
    max_batch_total_tokens: int
    scheduler: Scheduler | None
    _active: dict[int, _Active]
    _pending_adds: list[SequenceGroup]
    _between_steps: list[tuple[Callable[[Scheduler], object], asyncio.Future[object]]]
    _counters: EngineStats
    step_observers: list[Callable[[StepRecord], None]]
    _ahead_ids: set[int]
    _late: list[Sequence]
    held: dict[int, Sequence]

    def _fail(self, group_id: int, error: GenerationError) -> None:
        active = self._active.pop(group_id, None)
        if active is not None:
            active.sink.fail(group_id, status_of(error), str(error))
            self._count_finish("error")

    def _mark_scheduled(self, plan: StepPlan) -> None:
        """The first step that runs a request ends its queue time (TGI's queue duration)."""
        now = time.monotonic()
        for new in plan.new_requests:
            active = self._active.get(self._group_of(new.request_id))
            if active is not None and active.scheduled_at is None:
                active.scheduled_at = now

    def _observe_step(self, plan: StepPlan, duration_s: float, result: StepResult | None,
                      after_no_work: bool = False) -> None:
        """Tell the metrics of a step; after_no_work: the shards' wait before it was for work to
        arrive, not for the router (their idle time is left out)."""
        if not self.step_observers or plan.num_requests == 0:  # block operations only: no batch ran
            return
        prefill = bool(plan.new_requests) or any(r.num_compute > 1 + len(r.draft_token_ids)
                                                 for r in plan.running_requests)
        record = StepRecord(
            method="prefill" if prefill else "decode", ok=result is not None, duration_s=duration_s,
            forward_s=result.forward_ms / 1000.0 if result is not None else None,
            rank_total_s=[ms / 1000.0 for ms in getattr(self.client, "last_step_ms_by_rank", [])] if result else [],
            idle_s=result.idle_ms / 1000.0 if result is not None and not after_no_work else None,
        )
        for observe in self.step_observers:
            observe(record)

    def _group_of(self, seq_id: int) -> int:
        return seq_id // self.config.max_n

    def _postprocess(self, seq: Sequence, out: SeqOutput, num_generated: int | None = None) -> None:
        """Hand one sampled token to its request's sink, deciding whether it ends the choice.

        num_generated: the sequence's generated count with this token, when a verify step
        appended several at once (--speculate); tokens after one that finished it are dropped.
        """
        active = self._active.get(seq.group.group_id)
        if active is None or seq.is_finished:
            return
        if num_generated is None:
            num_generated = seq.num_generated
        if active.request.prompt_logprobs and seq.index == 0:
            active.prompt_logprobs.extend(out.prompt_logprobs)
            active.prompt_top_tokens.extend([(t.token_id, t.logprob) for t in top] for top in out.prompt_top_tokens)
        if out.embedding is not None:  # an embedding request: its prompt is computed, it is done
            active.sink.embedding(active.group.group_id, out.embedding, self._prompt_info(active))
            self._finish(active, seq, FinishReason.LENGTH)
            return
        token_id = out.token_id
        if token_id is None:
            return
        self._counters.generated_tokens += 1
        if active.request.adapter is not None:
            tokens = self._counters.adapter_generated_tokens
            tokens[active.request.adapter] = tokens.get(active.request.adapter, 0) + 1
        problem = self._grammar_problem(active, seq, token_id)
        if problem is not None:  # the token is not streamed: the request fails instead
            self._fail_now(active, GenerationError(f"{CONSTRAINT_FAILED}: {problem}"))
            return
        reason = self._finish_reason(num_generated, active.request, token_id)
        matcher = active.matchers.get(seq.seq_id)
        if matcher is not None and matcher.is_finished and reason is None:
            reason = FinishReason.EOS  # the grammar allows nothing more: the output is complete
        top = [(t.token_id, t.logprob) for t in out.top_tokens] if out.top_tokens else None
        prompt = self._prompt_info(active) if seq.index == 0 and num_generated == 1 else None
        active.sink.token(active.group.group_id, seq.index, token_id,
                          out.logprob if out.logprob is not None else 0.0, num_generated,
                          None if reason is None else reason.value, top, prompt)
        if reason is not None:
            del seq.output_ids[num_generated:]  # a verify step's tokens past the end never happened
            self._finish(active, seq, reason)

    def _draft_limit(self, seq: Sequence) -> int:
        """Tokens seq may draft this step (--speculate): none for constrained requests (a grammar
        mask holds for one position) or held blocks; never past max_new_tokens."""
        active = self._active.get(seq.group.group_id)
        if active is None or active.hold_blocks or active.matchers:
            return 0
        return active.request.max_new_tokens - seq.num_generated - 1

    def _matcher_of(self, seq_id: int) -> Matcher | None:
        active = self._active.get(self._group_of(seq_id))
        return active.matchers.get(seq_id) if active is not None else None

    def _grammar_problem(self, active: _Active, seq: Sequence, token_id: int) -> str | None:
        """Advance a constrained sequence's matcher by its sampled token; why it cannot take it
        (its lexer gave up, or the shard ignored the mask), or None."""
        matcher = active.matchers.get(seq.seq_id)
        if matcher is None or matcher.consume(token_id):
            return None
        log.error("sequence %d: token %d does not continue its grammar: %s", seq.seq_id, token_id, matcher.error)
        return matcher.error or f"token {token_id} does not continue it"

    def _fail_now(self, active: _Active, error: GenerationError) -> None:
        """Fail a running request from inside the loop: its stream ends with the error, its
        blocks are freed (it is in no step sent ahead: a constrained request never is)."""
        assert self.scheduler is not None
        group_id = active.group.group_id
        self._fail(group_id, error)
        self.scheduler.abort(group_id)

    def _finish_reason(self, num_generated: int, request: Submit, token_id: int) -> FinishReason | None:
        if (not request.ignore_eos and token_id in self.tokenizer.eos_token_ids) or token_id in request.stop_token_ids:
            return FinishReason.EOS
        if num_generated >= request.max_new_tokens:
            return FinishReason.LENGTH
        return None

    def _prompt_info(self, active: _Active) -> PromptInfo:
        prompt_logprobs: list[float | None] = []
        prompt_top: list[list[tuple[int, float]] | None] = []
        if active.request.prompt_logprobs:
            # Prompt positions served from the prefix cache have no logprob.
            missing = len(active.request.prompt_ids) - len(active.prompt_logprobs)
            prompt_logprobs = [None] * missing + active.prompt_logprobs
            if active.prompt_top_tokens:
                prompt_top = [None] * (len(active.request.prompt_ids) - len(active.prompt_top_tokens))
                prompt_top += active.prompt_top_tokens
        scheduled = active.scheduled_at if active.scheduled_at is not None else time.monotonic()
        return PromptInfo(active.group.num_cached_prompt_tokens, prompt_logprobs, scheduled, prompt_top)

    def _finish(self, active: _Active, seq: Sequence, reason: FinishReason) -> None:
        assert self.scheduler is not None
        held_table: list[int] = []
        if active.hold_blocks:  # the scheduler finishes a sequence that holds no blocks
            held_table, seq.block_table = seq.block_table, []
        if seq.seq_id in self._ahead_ids:
            self._late.append(seq)  # a step sent ahead still runs it: its blocks go after that step
        else:
            self.scheduler.finish(seq)
        if active.hold_blocks:
            seq.block_table = held_table  # freed by release_held
            self.held[active.group.group_id] = seq
        active.num_open -= 1
        self._count_finish(reason.value)
        if active.num_open == 0:
            self._active.pop(active.group.group_id, None)

    def _fail_all(self, err: Exception) -> None:
        status = status_of(err)
        for group_id, active in self._active.items():
            active.sink.fail(group_id, status, str(err))
        self._active.clear()
        for _, future in self._between_steps:
            if not future.done():
                future.set_exception(err)
        self._between_steps.clear()

    def _count_finish(self, key: str) -> None:
        counts = self._counters.requests_finished
        counts[key] = counts.get(key, 0) + 1

    # ---- metrics ---------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """Counters and gauges for the metrics collector."""
        stats = EngineStats(
            generated_tokens=self._counters.generated_tokens,
            steps=self._counters.steps,
            steps_planned_ahead=self._counters.steps_planned_ahead,
            requests_finished=dict(self._counters.requests_finished),
            adapter_requests=dict(self._counters.adapter_requests),
            adapter_prompt_tokens=dict(self._counters.adapter_prompt_tokens),
            adapter_generated_tokens=dict(self._counters.adapter_generated_tokens),
        )
        if self.scheduler is not None:
            s = self.scheduler.stats
            stats.num_waiting = s.num_waiting + len(self._pending_adds)
            stats.num_running = s.num_running
            stats.num_blocks_total = s.blocks_total
            stats.num_blocks_used = s.blocks_used
            stats.num_blocks_cached = s.blocks_cached
            stats.prompt_tokens_computed = s.prompt_tokens_computed
            stats.prompt_tokens_cached = s.prompt_tokens_cached
            stats.preemptions_swap = s.preemptions_swap
            stats.preemptions_recompute = s.preemptions_recompute
            if self.scheduler.speculator is not None:
                spec = self.scheduler.speculator.stats
                stats.spec_draft_tokens, stats.spec_accepted_tokens = spec.draft_tokens, spec.accepted_tokens
            stats.swapped_bytes = s.swapped_blocks * self._bytes_per_block()
            blocks = self.scheduler.block_manager
            stats.num_host_blocks_total = blocks.num_host_blocks
            stats.num_host_blocks_used = blocks.num_host_blocks - blocks.num_free_host_blocks
            stats.block_size = blocks.block_size
            stats.max_batch_total_tokens = self.max_batch_total_tokens
        stats.shard_healthy = list(getattr(self.client, "healthy_by_rank", []))
        return stats

    def _bytes_per_block(self) -> int:
        info = self.model_info
        if info is None:
            return 0
        itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}.get(info.dtype, 2)
        return 2 * info.num_layers * info.block_size * info.num_kv_heads * info.head_dim * itemsize
