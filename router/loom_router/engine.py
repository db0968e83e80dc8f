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
from typing import TYPE_CHECKING, Protocol, TypeVar

from loom_proto.config import RouterConfig
from loom_proto.step import ModelInfo, StepPlan, StepResult, WarmupResult
from loom_router.engine_requests import RequestBook, _Active
from loom_router.grammar import GrammarCompiler, MaskFiller
from loom_router.lookahead import AheadRole, InFlight, plan_ahead
from loom_router.request import Sequence, SequenceGroup
from loom_router.scheduler import Scheduler, SchedulerConfig
from loom_router.shard_client import ShardError
from loom_router.speculate import SpeculateConfig, Speculator, generated_counts
from loom_router.stream import DONE, GenerationStream
from loom_router.tokenizer import Tokenizer
from loom_router.types import (
    EngineStats,
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


class Engine(RequestBook):
    """The step loop, request admission and lifecycle; outputs are handled by RequestBook."""

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
        self._ahead_ids: set[int] = set()  # sequences in the step sent ahead (config.overlap_steps)
        self._late: list[Sequence] = []  # finished, but in the step ahead: freed after its outputs

    # ---- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Ask the shards what they hold, size the KV pool, start the step loop."""
        info = await self.client.info()
        self.model_info = info
        self.max_total_tokens = self.config.max_total_tokens or info.max_position_embeddings
        self.max_input_tokens = self.config.max_input_tokens or self.max_total_tokens - 1
        warm = await self.client.warmup(self.config.max_batch_prefill_tokens, self.config.max_batch_total_tokens)
        # Tokens of every layer: a block of tokens takes one block per KV group.
        self.max_batch_total_tokens = warm.num_blocks // info.num_kv_groups * warm.block_size
        self.scheduler = Scheduler(SchedulerConfig(
            block_size=warm.block_size,
            num_blocks=warm.num_blocks,
            num_host_blocks=warm.num_host_blocks,
            max_batch_prefill_tokens=self.config.max_batch_prefill_tokens,
            max_batch_total_tokens=self.max_batch_total_tokens,
            kv_group_windows=info.kv_group_windows,
        ))
        self._start_speculation()
        log.info("engine ready: %d KV blocks of %d tokens (%d tokens), %d host blocks",
                 warm.num_blocks, warm.block_size, self.max_batch_total_tokens, warm.num_host_blocks)
        self._loop_task = asyncio.create_task(self._run(), name="loom-engine")

    def _start_speculation(self) -> None:
        config = self.config
        if not config.speculate:
            return
        if config.overlap_steps:  # a step planned ahead cannot know how many drafts the one before kept
            log.warning("--speculate %d is off: --overlap-steps is on", config.speculate)
            return
        assert self.scheduler is not None
        self.scheduler.speculator = Speculator(
            SpeculateConfig(config.speculate, config.speculate_ngram_min, config.speculate_ngram_max),
            self._draft_limit)

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
        except (TimeoutError, GenerationError):  # the loop is stuck in a step, or gone
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

    # ---- the loop --------------------------------------------------------------------

    async def _run(self) -> None:
        assert self.scheduler is not None
        inflight: InFlight | None = None
        ahead: InFlight | None = None
        try:
            while True:
                if inflight is None:
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
                    if not self.config.overlap_steps:
                        self._take_outputs(plan, await self._step(plan), None)
                        await asyncio.sleep(0)  # let handlers stream and requests arrive
                        continue
                    inflight = InFlight(plan, asyncio.ensure_future(self._call(plan)))
                ahead = self._send_ahead(inflight.plan)
                outcome = await inflight.task
                if isinstance(outcome, Exception):
                    await self._recover(inflight.plan, outcome, ahead)
                    self._take_outputs(inflight.plan, None, None)
                    inflight = ahead = None
                    continue
                self._take_outputs(inflight.plan, outcome, ahead)
                inflight, ahead = ahead, None
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
        finally:
            for step in (inflight, ahead):
                if step is not None:
                    step.task.cancel()

    def _send_ahead(self, plan: StepPlan) -> InFlight | None:
        """Send the step after `plan` now, if it can be planned before plan's outputs (see lookahead)."""
        if self._pending_aborts or self._between_steps:
            return None  # they change what runs: apply them between two steps, as without lookahead
        assert self.scheduler is not None
        self._apply_pending()  # new requests: admitted into the step ahead when they fit
        ahead = plan_ahead(self.scheduler, plan, self._ahead_role)
        if ahead is None:
            return None
        self._mark_scheduled(ahead)
        self._masks.fill(ahead, self._matcher_of)
        return InFlight(ahead, asyncio.ensure_future(self._call(ahead)))

    def _take_outputs(self, plan: StepPlan, result: StepResult | None, ahead: InFlight | None) -> None:
        """Fold a step's outputs in. Sequences that finished one step earlier while already in
        this step get no event for its extra token, and free their blocks only now."""
        assert self.scheduler is not None
        finishing, self._late = self._late, []
        discard = {seq.seq_id for seq in finishing}
        self._ahead_ids = ahead.seq_ids if ahead is not None else set()
        if result is not None:
            updates = self.scheduler.update(plan, result)
            counts = generated_counts(updates) if self.scheduler.speculator else itertools.repeat(None)
            for (seq, out), num_generated in zip(updates, counts):
                if seq.seq_id not in discard:
                    self._postprocess(seq, out, num_generated)
        for seq in finishing:
            self.scheduler.finish(seq)

    def _ahead_role(self, seq: Sequence) -> AheadRole:
        active = self._active.get(seq.group.group_id)
        if any(late is seq for late in self._late):
            return AheadRole.SKIP  # finished; its step-late release is pending
        if active is None or active.hold_blocks or active.matchers:
            return AheadRole.BLOCK  # held blocks must not hold an extra token; grammars need each token
        if seq.num_generated + 1 >= active.params.max_new_tokens:
            return AheadRole.SKIP  # the step in flight samples its last token
        return AheadRole.RUN

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
        outcome = await self._call(plan)
        if isinstance(outcome, Exception):
            await self._recover(plan, outcome, None)
            return None
        return outcome

    async def _call(self, plan: StepPlan) -> StepResult | Exception:
        """Run plan on the shards; a failure comes back as a value (ShardDivergence propagates)."""
        start = time.perf_counter()
        try:
            with self._step_span(plan):
                result = await self.client.step(plan)
        except ShardDivergence:
            raise
        except Exception as err:
            self._observe_step(plan, time.perf_counter() - start, None)
            return err
        self._counters.steps += 1
        self._observe_step(plan, time.perf_counter() - start, result)
        return result

    def _step_span(self, plan: StepPlan) -> AbstractContextManager[None]:
        if self.tracer is None:
            return _NO_SPAN
        seq_ids = [r.request_id for r in plan.new_requests] + [r.request_id for r in plan.running_requests]
        return self.tracer.step(plan, sorted({self._group_of(seq_id) for seq_id in seq_ids}))

    async def _recover(self, plan: StepPlan, err: Exception, ahead: InFlight | None) -> None:
        """Roll back a failed step. A step sent ahead of it ran on what the failed one left:
        it is waited for (its blocks are freed only after it) and rolled back too."""
        assert self.scheduler is not None
        if ahead is not None:
            await asyncio.wait([ahead.task])
            if isinstance(ahead.task.exception(), ShardDivergence):
                raise ahead.task.exception()  # type: ignore[misc]
        failed, requeued = self.scheduler.rollback(plan)
        if ahead is not None:
            failed = sorted({*failed, *self.scheduler.rollback(ahead.plan)[0]})
        log.error("step failed: %s; failing requests %s", err, failed)
        if requeued:
            log.warning("requests %s were being swapped out by the failed step: they resume by "
                        "recomputing their KV", requeued)
        for group_id in failed:
            self._fail(group_id, GenerationError(f"Request failed during generation: {err}"))
        await self._check_shards_after(err)  # the streams got their error first

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

