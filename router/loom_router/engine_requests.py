"""The engine's request bookkeeping: what happens to a step's outputs and to finished requests.

`Engine` (loom_router.engine) runs the step loop; this base class owns the per-request
state it feeds: detokenizers and stop matchers, grammar matchers, finishing and failing
streams, and the counters the metrics read. Everything here runs inside the loop task.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from loom_proto.config import RouterConfig
from loom_proto.step import ModelInfo, SeqOutput, StepPlan, StepResult
from loom_router.grammar import Matcher
from loom_router.request import Sequence, SequenceGroup
from loom_router.scheduler import Scheduler
from loom_router.stream import DONE, GenerationStream
from loom_router.text import IncrementalDetokenizer, StopMatcher
from loom_router.tokenizer import Tokenizer
from loom_router.types import (
    ChoiceEvent,
    EngineStats,
    FinishReason,
    GeneratedToken,
    GenerationError,
    GenerationParams,
    StepRecord,
)

log = logging.getLogger("loom.engine")


@dataclass(slots=True)
class _SeqText:
    """Per-sequence text state: detokenizer, stop matcher and its finish decision."""

    detokenizer: IncrementalDetokenizer
    stop: StopMatcher


@dataclass(slots=True)
class _Active:
    group: SequenceGroup
    params: GenerationParams
    stream: GenerationStream
    texts: dict[int, _SeqText]  # by seq_id
    num_open: int  # choices not finished yet
    arrival: float
    prompt_logprobs: list[float | None]  # filled chunk by chunk when asked for
    hold_blocks: bool = False  # keep the finished sequence's blocks (see GenerationStream.held)
    matchers: dict[int, Matcher] = field(default_factory=dict)  # by seq_id, for constrained requests


class RequestBook:
    """Per-request state and output processing, shared by the engine's loop (its subclass)."""

    config: RouterConfig
    client: object
    tokenizer: Tokenizer
    model_info: ModelInfo | None
    max_batch_total_tokens: int
    scheduler: Scheduler | None
    _active: dict[int, _Active]
    _pending_adds: list[SequenceGroup]
    _between_steps: list[tuple[Callable[[Scheduler], object], asyncio.Future[object]]]
    _counters: EngineStats
    step_observers: list[Callable[[StepRecord], None]]
    _ahead_ids: set[int]
    _late: list[Sequence]

    def _new_text(self, prompt_ids: list[int], params: GenerationParams) -> _SeqText:
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
        return _SeqText(detokenizer, StopMatcher(params.stop_sequences))

    def _fail(self, group_id: int, error: GenerationError) -> None:
        active = self._active.pop(group_id, None)
        if active is not None:
            active.stream.closed = True
            active.stream.put(error)
            self._count_finish("error", active)

    def _mark_scheduled(self, plan: StepPlan) -> None:
        """The first step that runs a request ends its queue time (TGI's queue duration)."""
        now = time.perf_counter()
        for new in plan.new_requests:
            active = self._active.get(self._group_of(new.request_id))
            if active is not None and active.stream.scheduled_at is None:
                active.stream.scheduled_at = now

    def _observe_step(self, plan: StepPlan, duration_s: float, result: StepResult | None) -> None:
        if not self.step_observers or plan.num_requests == 0:  # block operations only: no batch ran
            return
        prefill = bool(plan.new_requests) or any(r.num_compute > 1 + len(r.draft_token_ids)
                                                 for r in plan.running_requests)
        record = StepRecord(
            method="prefill" if prefill else "decode", ok=result is not None, duration_s=duration_s,
            forward_s=result.forward_ms / 1000.0 if result is not None else None,
            rank_total_s=[ms / 1000.0 for ms in getattr(self.client, "last_step_ms_by_rank", [])] if result else [],
        )
        for observe in self.step_observers:
            observe(record)

    def _group_of(self, seq_id: int) -> int:
        return seq_id // self.config.max_n

    def _postprocess(self, seq: Sequence, out: SeqOutput, num_generated: int | None = None) -> None:
        """Turn one sampled token into a ChoiceEvent: detokenize, check stops, finish.

        num_generated: the sequence's generated count with this token, when a verify step
        appended several at once (--speculate); tokens after one that finished it are dropped.
        """
        active = self._active.get(seq.group.group_id)
        if active is None or seq.is_finished:
            return
        if num_generated is None:
            num_generated = seq.num_generated
        if active.params.prompt_logprobs and seq.index == 0:
            active.prompt_logprobs.extend(out.prompt_logprobs)
        if out.token_id is None:
            return
        if seq.index == 0 and num_generated == 1:
            self._record_prompt(active, out)
        token_id = out.token_id
        self._counters.generated_tokens += 1
        text = active.texts[seq.seq_id]
        params = active.params
        if not params.skip_special_tokens and not params.ignore_eos and token_id in self.tokenizer.eos_token_ids:
            delta = ""  # specials are kept (a tool-call marker), but the EOS that ends the answer is no text
        else:
            delta = text.detokenizer.add(token_id)  # the text this token adds (TGI's token.text)
        emitted, stopped = text.stop.feed(delta)
        reason = self._finish_reason(num_generated, active.params, token_id, stopped)
        if self._grammar_ended(active, seq, token_id) and reason is None:
            reason = FinishReason.EOS  # the grammar allows nothing more: the output is complete
        if reason is not None and reason is not FinishReason.STOP:
            held = text.detokenizer.flush()
            delta += held
            tail, stopped = text.stop.feed(held)
            emitted += tail if stopped else tail + text.stop.flush()
            reason = FinishReason.STOP if stopped else reason
        token = GeneratedToken(
            token_id=token_id,
            text=delta,
            logprob=out.logprob if out.logprob is not None else 0.0,
            special=self.tokenizer.is_special(token_id),
            top_tokens=out.top_tokens,
        )
        active.stream.put(ChoiceEvent(seq.index, token, emitted, reason, num_generated))
        if reason is not None:
            del seq.output_ids[num_generated:]  # a verify step's tokens past the stop never happened
            self._finish(active, seq, reason)

    def _draft_limit(self, seq: Sequence) -> int:
        """Tokens seq may draft this step (--speculate): none for constrained requests (a grammar
        mask holds for one position) or held blocks; never past max_new_tokens."""
        active = self._active.get(seq.group.group_id)
        if active is None or active.hold_blocks or active.matchers:
            return 0
        return active.params.max_new_tokens - seq.num_generated - 1

    def _matcher_of(self, seq_id: int) -> Matcher | None:
        active = self._active.get(self._group_of(seq_id))
        return active.matchers.get(seq_id) if active is not None else None

    def _grammar_ended(self, active: _Active, seq: Sequence, token_id: int) -> bool:
        """Advance a constrained sequence's matcher; True when its grammar is complete."""
        matcher = active.matchers.get(seq.seq_id)
        if matcher is None:
            return False
        if not matcher.consume(token_id):  # the shard ignored the mask: a bug, not the client's
            log.error("sequence %d sampled token %d outside its grammar: %s", seq.seq_id, token_id, matcher.error)
            return True
        return matcher.is_finished

    def _finish_reason(self, num_generated: int, params: GenerationParams, token_id: int,
                       stopped: bool) -> FinishReason | None:
        if stopped:
            return FinishReason.STOP
        if not params.ignore_eos and token_id in self.tokenizer.eos_token_ids:
            return FinishReason.EOS
        if num_generated >= params.max_new_tokens:
            return FinishReason.LENGTH
        return None

    def _record_prompt(self, active: _Active, out: SeqOutput) -> None:
        prompt = active.stream.prompt
        prompt.num_cached_tokens = active.group.num_cached_prompt_tokens
        if active.params.prompt_logprobs:
            # Prompt positions served from the prefix cache have no logprob.
            missing = prompt.num_prompt_tokens - len(active.prompt_logprobs)
            prompt.prompt_logprobs = [None] * missing + active.prompt_logprobs

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
            active.stream.held = seq
        active.num_open -= 1
        self._count_finish(reason.value, active)
        if active.num_open == 0:
            self._active.pop(active.group.group_id, None)
            active.stream.closed = True
            active.stream.put(DONE)

    def _fail_all(self, err: Exception) -> None:
        for active in self._active.values():
            active.stream.closed = True
            active.stream.put(err)
        self._active.clear()
        for _, future in self._between_steps:
            if not future.done():
                future.set_exception(err)
        self._between_steps.clear()

    def _count_finish(self, key: str, active: _Active) -> None:
        counts = self._counters.requests_finished
        counts[key] = counts.get(key, 0) + 1
        active.stream.outcome = key

    # ---- metrics ---------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """Counters and gauges for the metrics collector."""
        stats = EngineStats(
            generated_tokens=self._counters.generated_tokens,
            steps=self._counters.steps,
            requests_finished=dict(self._counters.requests_finished),
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
