"""The router's engine: one loop that schedules, steps the shards and streams tokens.

    plan   = scheduler.schedule()      # allocates via the block manager
    result = await shards.step(plan)   # same message to every TP shard
    for seq, out in scheduler.update(plan, result): postprocess(seq, out)

HTTP handlers talk to it through `submit()` and the `GenerationStream` it returns.
Every scheduler mutation happens inside the loop task, between steps; code outside the
loop (snapshots) hands it callables through `run_between_steps()`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

from loom_proto.config import RouterConfig
from loom_proto.step import ModelInfo, SeqOutput, StepPlan, StepResult, WarmupResult
from loom_router.grammar import GrammarCompiler, MaskFiller, Matcher
from loom_router.request import Sequence, SequenceGroup
from loom_router.scheduler import Scheduler, SchedulerConfig
from loom_router.shard_client import ShardError
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
    OverloadedError,
    ShardDivergence,
    StepRecord,
    UnavailableError,
    ValidationError,
)

if TYPE_CHECKING:
    from loom_router.tracing import RequestTracer

log = logging.getLogger("loom.engine")
_NO_SPAN = nullcontext()  # reusable: no allocation per step while tracing is off

T = TypeVar("T")
DRAIN_ABORT_TIMEOUT_S = 5.0


class ShardBackend(Protocol):
    """What the engine needs of the shards: `ShardClient`, or a fake one in tests."""

    async def info(self) -> ModelInfo: ...
    async def health(self) -> bool: ...
    async def warmup(self, max_prefill_tokens: int, max_batch_total_tokens: int | None) -> WarmupResult: ...
    async def step(self, plan: StepPlan) -> StepResult: ...


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


class Engine:
    def __init__(self, config: RouterConfig, client: ShardBackend, tokenizer: Tokenizer) -> None:
        self.config = config
        self.client = client
        self.tokenizer = tokenizer
        self.model_info: ModelInfo | None = None
        self.max_total_tokens = 0
        self.max_input_tokens = 0
        self.max_batch_total_tokens = 0
        self.scheduler: Scheduler | None = None
        self._active: dict[int, _Active] = {}
        self._pending_adds: list[SequenceGroup] = []
        self._pending_aborts: set[int] = set()
        self._between_steps: list[tuple[Callable[[Scheduler], object], asyncio.Future[object]]] = []
        self._ids = itertools.count()
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._draining = False
        self._shard_down = False  # a shard stopped answering: nothing can be served any more
        self._loop_error: BaseException | None = None
        self._counters = EngineStats()
        # Called when the loop dies (a bug, or tensor-parallel ranks that diverged).
        self.on_fatal: Callable[[BaseException], None] | None = None
        self.step_observers: list[Callable[[StepRecord], None]] = []  # the metrics, told of every step
        self.tracer: RequestTracer | None = None  # --otlp-endpoint: a `step` span around each step
        self.grammars = GrammarCompiler(tokenizer)
        self._masks = MaskFiller(self.grammars)

    # ---- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Ask the shards what they hold, size the KV pool, start the step loop."""
        info = await self.client.info()
        self.model_info = info
        self.max_total_tokens = self.config.max_total_tokens or info.max_position_embeddings
        self.max_input_tokens = self.config.max_input_tokens or self.max_total_tokens - 1
        warm = await self.client.warmup(self.config.max_batch_prefill_tokens, self.config.max_batch_total_tokens)
        self.max_batch_total_tokens = warm.num_blocks * warm.block_size
        self.scheduler = Scheduler(SchedulerConfig(
            block_size=warm.block_size,
            num_blocks=warm.num_blocks,
            num_host_blocks=warm.num_host_blocks,
            max_batch_prefill_tokens=self.config.max_batch_prefill_tokens,
            max_batch_total_tokens=self.max_batch_total_tokens,
        ))
        log.info("engine ready: %d KV blocks of %d tokens (%d tokens), %d host blocks",
                 warm.num_blocks, warm.block_size, self.max_batch_total_tokens, warm.num_host_blocks)
        self._loop_task = asyncio.create_task(self._run(), name="loom-engine")

    async def stop(self, drain_timeout_s: float = 60.0) -> None:
        """Graceful drain: refuse new work, let in-flight requests finish, stop the loop."""
        self._draining = True
        deadline = time.monotonic() + drain_timeout_s
        while self._active and time.monotonic() < deadline and self._loop_alive():
            await asyncio.sleep(0.05)
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except (asyncio.CancelledError, Exception):
                pass
        for _, future in self._between_steps:
            future.cancel()

    @property
    def accepting(self) -> bool:
        """Ready for new requests: warmed up, not draining, the loop running, every shard up."""
        return self.scheduler is not None and not self._draining and not self._shard_down and self._loop_alive()

    def begin_drain(self) -> None:
        """Refuse new requests from now on (readiness fails at once)."""
        self._draining = True

    async def drain(self, timeout_s: float) -> None:
        """Let in-flight requests finish within `timeout_s`; the rest then end with an error event."""
        self.begin_drain()
        deadline = time.monotonic() + timeout_s
        while self._active and time.monotonic() < deadline and self._loop_alive():
            await asyncio.sleep(0.05)
        if not self._active:
            return
        log.warning("%d request(s) still running after %g s of draining: ending them", len(self._active), timeout_s)
        error = GenerationError(f"the server shut down before this request finished "
                                f"(--graceful-termination-timeout {timeout_s:g} s)")
        try:  # between steps, so that no step's output lands on a request that is gone
            await asyncio.wait_for(self.run_between_steps(lambda scheduler: self._abort_all(scheduler, error)),
                                   timeout=DRAIN_ABORT_TIMEOUT_S)
        except (asyncio.TimeoutError, GenerationError):  # the loop is stuck in a step, or gone
            self._fail_all(error)

    def _abort_all(self, scheduler: Scheduler, error: GenerationError) -> None:
        for group_id, active in list(self._active.items()):
            if active.group not in self._pending_adds:
                scheduler.abort(group_id)
            self._count_finish("error", active)
        self._pending_adds.clear()
        self._fail_all(error)

    async def health(self) -> bool:
        if not self._loop_alive():
            return False
        try:
            return await self.client.health()
        except Exception:
            return False

    def _loop_alive(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    # ---- requests --------------------------------------------------------------------

    def validate_lengths(self, num_input_tokens: int, max_new_tokens: int | None, n: int) -> int:
        """Check a request's lengths against the limits; returns its max_new_tokens.

        Unset, max_new_tokens is the whole rest of the context.
        """
        if num_input_tokens == 0:
            raise ValidationError("Input validation error: `inputs` cannot be empty")
        if num_input_tokens > self.max_input_tokens:
            raise ValidationError(
                f"Input validation error: `inputs` must have less than {self.max_input_tokens + 1} tokens. "
                f"Given: {num_input_tokens}")
        if max_new_tokens is None:
            max_new_tokens = self.max_total_tokens - num_input_tokens
        if max_new_tokens <= 0:
            raise ValidationError(f"Input validation error: `max_new_tokens` must be strictly positive. "
                                  f"Given: {max_new_tokens}")
        if num_input_tokens + max_new_tokens > self.max_total_tokens:
            raise ValidationError(
                f"Input validation error: `inputs` tokens + `max_new_tokens` must be <= {self.max_total_tokens}. "
                f"Given: {num_input_tokens} `inputs` tokens and {max_new_tokens} `max_new_tokens`")
        assert self.scheduler is not None
        if not self.scheduler.can_ever_fit(num_input_tokens + max_new_tokens, n):
            raise ValidationError(
                f"Input validation error: {n} sequence(s) of {num_input_tokens} + {max_new_tokens} tokens "
                f"cannot fit in the KV cache ({self.max_batch_total_tokens} tokens) even alone")
        return max_new_tokens

    def submit(self, prompt_ids: list[int], params: GenerationParams, hold_blocks: bool = False) -> GenerationStream:
        """Queue one request; its events arrive on the returned stream.

        hold_blocks (n == 1): when it finishes, its blocks stay allocated in `stream.held`
        until `release_held(stream)`; a cancelled or failed request holds nothing.
        """
        assert not hold_blocks or params.n == 1
        if self._draining:
            raise OverloadedError("the server is shutting down")
        if not self._loop_alive():
            raise GenerationError(f"the engine loop is not running: {self._loop_error!r}")
        if self._shard_down:
            raise UnavailableError("a shard is down; retry on another replica")
        if len(self._active) >= self.config.max_concurrent_requests:
            raise OverloadedError(f"Model is overloaded: {len(self._active)} requests in flight "
                                  f"(--max-concurrent-requests {self.config.max_concurrent_requests})")
        self.validate_lengths(len(prompt_ids), params.max_new_tokens, params.n)
        group_id = next(self._ids)
        group = SequenceGroup.create(
            group_id=group_id,
            prompt_ids=list(prompt_ids),
            samplings=params.choices,
            first_seq_id=group_id * self.config.max_n,
            prompt_logprobs=params.prompt_logprobs,
        )
        stream = GenerationStream(self.cancel, group_id, len(prompt_ids), self.config.stream_buffer_events)
        stream.max_new_tokens = params.max_new_tokens
        texts = {seq.seq_id: self._new_text(prompt_ids, params) for seq in group.seqs}
        self._active[group_id] = _Active(group, params, stream, texts, params.n, time.monotonic(), [None],
                                         hold_blocks)
        if params.grammar is not None:
            self._active[group_id].matchers = {seq.seq_id: params.grammar.new_matcher() for seq in group.seqs}
        self._pending_adds.append(group)
        self._wakeup.set()
        return stream

    def cancel(self, group_id: int) -> None:
        if group_id in self._active:
            self._pending_aborts.add(group_id)
            self._wakeup.set()

    def run_between_steps(self, fn: Callable[[Scheduler], T]) -> asyncio.Future[T]:
        """Run fn(scheduler) in the loop, before the next schedule(); its result (or
        exception) comes back on the future. A future cancelled before then skips fn."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        if not self._loop_alive():
            future.set_exception(GenerationError(f"the engine loop is not running: {self._loop_error!r}"))
            return future
        self._between_steps.append((fn, future))  # type: ignore[arg-type]
        self._wakeup.set()
        return future

    def release_held(self, stream: GenerationStream) -> None:
        """Give back the blocks a hold_blocks request kept (between steps; idempotent)."""
        seq, stream.held = stream.held, None
        if seq is not None:
            self.run_between_steps(lambda scheduler: scheduler.block_manager.free(seq))

    def _new_text(self, prompt_ids: list[int], params: GenerationParams) -> _SeqText:
        return _SeqText(IncrementalDetokenizer(self.tokenizer, prompt_ids), StopMatcher(params.stop_sequences))

    # ---- the loop --------------------------------------------------------------------

    async def _run(self) -> None:
        assert self.scheduler is not None
        try:
            while True:
                self._apply_pending()
                self._run_between_steps()
                plan = self.scheduler.schedule()
                if plan is None:
                    self._wakeup.clear()
                    if not (self._pending_adds or self._pending_aborts or self._between_steps):
                        await self._wakeup.wait()
                    continue
                self._mark_scheduled(plan)
                self._masks.fill(plan, self._matcher_of)
                result = await self._step(plan)
                if result is not None:
                    for seq, out in self.scheduler.update(plan, result):
                        self._postprocess(seq, out)
                # Let handlers stream and new requests arrive even when the shard answers at once.
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except BaseException as err:  # a bug here must not leave clients hanging
            log.critical("engine loop crashed: %s", err, exc_info=not isinstance(err, ShardDivergence))
            self._loop_error = err
            self._fail_all(GenerationError(f"engine loop crashed: {err!r}"))
            if self.on_fatal is not None:
                self.on_fatal(err)  # the process exits non-zero: the launcher tears everything down
            raise

    def _apply_pending(self) -> None:
        assert self.scheduler is not None
        for group_id in self._pending_aborts:
            active = self._active.pop(group_id, None)
            if active is None:
                continue
            if active.group in self._pending_adds:
                self._pending_adds.remove(active.group)
            else:
                self.scheduler.abort(group_id)
            active.stream.closed = True
            active.stream.put(DONE)
            self._count_finish("cancelled", active)
        self._pending_aborts.clear()
        for group in self._pending_adds:
            self.scheduler.add(group)
        self._pending_adds.clear()

    def _run_between_steps(self) -> None:
        calls, self._between_steps = self._between_steps, []
        for fn, future in calls:
            if future.cancelled():
                continue
            try:
                future.set_result(fn(self.scheduler))
            except Exception as err:  # the caller's failure, not the loop's
                future.set_exception(err)

    async def _step(self, plan: StepPlan) -> StepResult | None:
        """One step on the shards. A failure fails the requests in it, not the server, and
        the scheduler rolls back what a later step would trust; ranks that diverged
        (ShardDivergence) are fatal and propagate."""
        start = time.perf_counter()
        try:
            with self._step_span(plan):
                result = await self.client.step(plan)
        except ShardDivergence:
            raise
        except Exception as err:
            self._observe_step(plan, time.perf_counter() - start, None)
            assert self.scheduler is not None
            failed, requeued = self.scheduler.rollback(plan)
            log.error("step failed: %s; failing requests %s", err, failed)
            if requeued:
                log.warning("requests %s were being swapped out by the failed step: they resume by "
                            "recomputing their KV", requeued)
            for group_id in failed:
                self._fail(group_id, GenerationError(f"Request failed during generation: {err}"))
            await self._check_shards_after(err)  # the streams got their error first
            return None
        self._counters.steps += 1
        self._observe_step(plan, time.perf_counter() - start, result)
        return result

    def _step_span(self, plan: StepPlan) -> AbstractContextManager[None]:
        if self.tracer is None:
            return _NO_SPAN
        seq_ids = [r.request_id for r in plan.new_requests] + [r.request_id for r in plan.running_requests]
        return self.tracer.step(plan, sorted({self._group_of(seq_id) for seq_id in seq_ids}))

    def _fail(self, group_id: int, error: GenerationError) -> None:
        active = self._active.pop(group_id, None)
        if active is not None:
            active.stream.closed = True
            active.stream.put(error)
            self._count_finish("error", active)

    async def _check_shards_after(self, err: Exception) -> None:
        """A shard that is unreachable, or fails Health after a failed step, is down: new
        requests then get 503 at the door (loom_router.guard) until the launcher restarts all."""
        if isinstance(err, ShardError) and err.code == "UNAVAILABLE":
            self._shard_down = True
        else:
            try:
                self._shard_down = not await self.client.health()
            except Exception:
                self._shard_down = True
        if self._shard_down and self.scheduler is not None:
            # Requests admitted meanwhile (and any still running) cannot run either: 503, not 424.
            self._abort_all(self.scheduler, UnavailableError(f"a shard is down ({err}); retry on another replica"))

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
        prefill = bool(plan.new_requests) or any(r.num_compute > 1 for r in plan.running_requests)
        record = StepRecord(
            method="prefill" if prefill else "decode", ok=result is not None, duration_s=duration_s,
            forward_s=result.forward_ms / 1000.0 if result is not None else None,
            rank_total_s=[ms / 1000.0 for ms in getattr(self.client, "last_step_ms_by_rank", [])] if result else [],
        )
        for observe in self.step_observers:
            observe(record)

    def _group_of(self, seq_id: int) -> int:
        return seq_id // self.config.max_n

    def _postprocess(self, seq: Sequence, out: SeqOutput) -> None:
        """Turn one sampled token into a ChoiceEvent: detokenize, check stops, finish."""
        active = self._active.get(seq.group.group_id)
        if active is None:
            return
        if active.params.prompt_logprobs and seq.index == 0:
            active.prompt_logprobs.extend(out.prompt_logprobs)
        if out.token_id is None:
            return
        if seq.index == 0 and seq.num_generated == 1:
            self._record_prompt(active, out)
        token_id = out.token_id
        self._counters.generated_tokens += 1
        text = active.texts[seq.seq_id]
        delta = text.detokenizer.add(token_id)  # the text this token adds (TGI's token.text)
        emitted, stopped = text.stop.feed(delta)
        reason = self._finish_reason(seq, active.params, token_id, stopped)
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
        active.stream.put(ChoiceEvent(seq.index, token, emitted, reason, seq.num_generated))
        if reason is not None:
            self._finish(active, seq, reason)

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

    def _finish_reason(self, seq: Sequence, params: GenerationParams, token_id: int,
                       stopped: bool) -> FinishReason | None:
        if stopped:
            return FinishReason.STOP
        if not params.ignore_eos and token_id in self.tokenizer.eos_token_ids:
            return FinishReason.EOS
        if seq.num_generated >= params.max_new_tokens:
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
