"""The engine core's loop: it schedules, steps the shards and hands each token to its sink.

    plan   = scheduler.schedule()      # allocates via the block manager
    result = await shards.step(plan)   # same message to every TP shard
    for seq, out in scheduler.update(plan, result): postprocess(seq, out)

Requests come in through `add()` (loom_router.core.server, for the frontends); cancels and stop
strings the frontends found come in through `cancel()` and `stop_choice()`, applied between steps.
Every scheduler mutation happens inside the loop task, between steps; code outside the loop
(snapshots) hands it callables through `run_between_steps()`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Protocol, TypeVar

from loom_proto.codec import unencodable_requests
from loom_proto.config import RouterConfig
from loom_proto.step import ModelInfo, Pooling, StepPlan, StepResult, WarmupResult
from loom_router.contract import Limits, Status, Submit, check_lengths
from loom_router.core.adapters import AdapterRegistry
from loom_router.core.engine_requests import CONSTRAINT_FAILED, RequestBook, Sink, _Active
from loom_router.core.lookahead import AheadRole, InFlight, plan_ahead
from loom_router.core.request import Sequence, SequenceGroup
from loom_router.core.scheduler import Scheduler, SchedulerConfig
from loom_router.core.shard_client import ShardError
from loom_router.core.shard_watch import ShardWatch
from loom_router.core.speculate import SpeculateConfig, Speculator, generated_counts
from loom_router.structured.grammar import Grammar, GrammarCompiler, MaskFiller
from loom_router.tokenizer import Tokenizer
from loom_router.types import (
    EngineStats,
    FinishReason,
    GenerationError,
    OverloadedError,
    ShardDivergence,
    StepRecord,
    UnavailableError,
    ValidationError,
    client_text,
    shutting_down,
)

if TYPE_CHECKING:
    from loom_router.observability.tracing import RequestTracer

log = logging.getLogger("loom.engine")
_NO_SPAN = nullcontext()  # reusable: no allocation per step while tracing is off

T = TypeVar("T")
DRAIN_ABORT_TIMEOUT_S = 5.0


def context_limits(config: RouterConfig, model_context: int) -> tuple[int, int]:
    """(max total, max input) tokens per request: the flags', else the model's context. Input
    that leaves no room for output is refused (ValueError); a total past the model's context is
    served, with a warning (positions the model never learned)."""
    total = config.max_total_tokens or model_context
    max_input = config.max_input_tokens or total - 1
    if max_input >= total:
        raise ValueError(f"--max-input-tokens ({max_input}) must be below the tokens a request may hold "
                         f"({total}: --max-total-tokens, by default the model's context)")
    if total > model_context:
        log.warning("--max-total-tokens %d is past the model's context (%d tokens): positions past it "
                    "were never trained and may give poor output", total, model_context)
    return total, max_input


def fit_kv_cache(config: RouterConfig, total: int, max_input: int, capacity: int) -> tuple[int, int]:
    """(max total, max input) tokens a request may hold, within what the KV cache holds for one
    request (`capacity`): a default past it is lowered to it (a request without a token limit
    runs to the end of the context, and must fit); limits a flag set are kept, with a warning."""
    if total <= capacity:
        return total, max_input
    if config.max_total_tokens is not None or config.max_input_tokens is not None:
        log.warning("a request may hold %d tokens (--max-total-tokens) but the KV cache holds %d for one: "
                    "a request asking for more is refused (raise --max-batch-total-tokens)", total, capacity)
        return total, max_input
    log.warning("the context is %d tokens, the KV cache holds %d for one request: requests may hold %d "
                "(--max-batch-total-tokens, or the memory, sets the cache)", total, capacity, capacity)
    return capacity, min(max_input, capacity - 1)


def overlaps(config: RouterConfig, device: str) -> bool:
    """--overlap-steps, or by default: on where the shards compute on a GPU (the engine core plans
    step n+1 while the GPU runs step n) and nothing is drafted; off where they share the CPU with
    the router (there the plan's work would only compete for the same cores)."""
    if config.overlap_steps is not None:
        return config.overlap_steps
    return device.startswith("cuda") and not config.speculate


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
        self.limits: Limits | None = None
        self.max_total_tokens = 0
        self.max_input_tokens = 0
        self.max_batch_total_tokens = 0
        self.max_batch_prefill_tokens = 0
        self.scheduler: Scheduler | None = None
        self._active: dict[int, _Active] = {}
        self._pending_adds: list[SequenceGroup] = []
        self._pending_aborts: dict[int, str] = {}  # group id -> outcome ("cancelled" or "error")
        self._pending_stops: list[tuple[int, int, int]] = []  # (group id, choice, num_generated)
        self.held: dict[int, Sequence] = {}  # hold_blocks requests that finished, until release_held
        self._constrained: set[int] = set()  # groups with a grammar, maybe finished since
        self._between_steps: list[tuple[Callable[[Scheduler], object], asyncio.Future[object]]] = []
        self._ids = itertools.count()
        self._wakeup = asyncio.Event()
        # The next step follows a time with nothing to run: the shards' wait before it is nobody's
        # delay (not counted in loom_shard_idle_seconds). True at start: they waited since warmup.
        self._after_no_work = True
        self._loop_task: asyncio.Task[None] | None = None
        self._draining = False
        # down: new requests get 503, no step runs
        self._watch = ShardWatch(lambda: self.client.health(), on_change=self._status_changed)
        self._watch_task: asyncio.Task[None] | None = None
        self._loop_error: BaseException | None = None
        self._counters = EngineStats()
        # Called when the loop dies (a bug, or tensor-parallel ranks that diverged).
        self.on_fatal: Callable[[BaseException], None] | None = None
        self.step_observers: list[Callable[[StepRecord], None]] = []  # the metrics, told of every step
        self.status_observers: list[Callable[[Status], None]] = []  # the frontends, told when `accepting` changes
        self.tracer: RequestTracer | None = None  # --otlp-endpoint: a `step` span around each step
        self.grammars = GrammarCompiler(tokenizer)
        self._masks = MaskFiller(self.grammars)
        self.overlap_steps = False  # decided at start (overlaps): one step planned ahead of the shards'
        self._ahead_ids: set[int] = set()  # sequences in the step sent ahead (overlap_steps)
        self._late: list[Sequence] = []  # finished, but in the step ahead: freed after its outputs
        self.adapters = AdapterRegistry(client, config.enable_lora, self._adapter_in_use)  # type: ignore[arg-type]

    # ---- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Ask the shards what they hold, size the KV pool, start the step loop."""
        info = await self.client.info()
        self.model_info = info
        self.overlap_steps = overlaps(self.config, info.device)
        self.max_total_tokens, self.max_input_tokens = context_limits(self.config, info.max_position_embeddings)
        self.max_batch_prefill_tokens = self.config.prefill_budget(info.device)
        warm = await self.client.warmup(self.max_batch_prefill_tokens, self.config.max_batch_total_tokens)
        # Tokens of every layer: a block of tokens takes one block per KV group.
        self.max_batch_total_tokens = warm.num_blocks // info.num_kv_groups * warm.block_size
        scheduler_config = SchedulerConfig(
            block_size=warm.block_size,
            num_blocks=warm.num_blocks,
            num_host_blocks=warm.num_host_blocks,
            max_batch_prefill_tokens=self.max_batch_prefill_tokens,
            max_batch_total_tokens=self.max_batch_total_tokens,
            kv_group_windows=info.kv_group_windows,
            max_loras_per_batch=self.config.max_loras_per_batch,
        )
        self.scheduler = Scheduler(scheduler_config)
        one_request = scheduler_config.num_usable_blocks // info.num_kv_groups * warm.block_size
        self.max_total_tokens, self.max_input_tokens = fit_kv_cache(
            self.config, self.max_total_tokens, self.max_input_tokens, one_request)
        self.limits = Limits(self.max_total_tokens, self.max_input_tokens, self.max_batch_total_tokens,
                             self.max_batch_prefill_tokens, warm.block_size, scheduler_config.num_usable_blocks,
                             scheduler_config.max_num_seqs, info.num_kv_groups)
        self._start_speculation()
        await self.adapters.load_all(self.config.lora_adapter)  # BadRequestError: the server does not start
        log.info("engine ready: %d KV blocks of %d tokens (%d tokens), %d host blocks",
                 warm.num_blocks, warm.block_size, self.max_batch_total_tokens, warm.num_host_blocks)
        self._loop_task = asyncio.create_task(self._run(), name="loom-engine")
        self._watch_task = asyncio.create_task(self._watch.run(), name="loom-shard-watch")
        self._status_changed()

    def _start_speculation(self) -> None:
        config = self.config
        if not config.speculate:
            return
        if self.overlap_steps:  # a step planned ahead cannot know how many drafts the one before kept
            log.warning("--speculate %d is off: --overlap-steps is on", config.speculate)
            return
        assert self.scheduler is not None
        self.scheduler.speculator = Speculator(
            SpeculateConfig(config.speculate, config.speculate_ngram_min, config.speculate_ngram_max),
            self._draft_limit)

    async def stop(self, drain_timeout_s: float = 60.0) -> None:
        """Graceful drain: refuse new work, let in-flight requests finish, stop the loop."""
        self.begin_drain()
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
        if self._watch_task is not None:
            self._watch_task.cancel()
        self.grammars.close()

    @property
    def accepting(self) -> bool:
        """Ready for new requests: warmed up, not draining, the loop running, every shard up."""
        return self.scheduler is not None and not self._draining and not self._watch.down and self._loop_alive()

    @property
    def status(self) -> Status:
        reason = ("draining" if self._draining else "a shard is down" if self._watch.down
                  else "" if self._loop_alive() else "the engine loop is not running")
        return Status(self.accepting, self._draining, reason)

    def _status_changed(self) -> None:
        status = self.status
        for observe in self.status_observers:
            observe(status)

    def begin_drain(self) -> None:
        """Refuse new requests from now on (readiness fails at once)."""
        if not self._draining:
            self._draining = True
            self._status_changed()

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
            self._count_finish("error")
        self._pending_adds.clear()
        self._fail_all(error)

    async def health(self) -> bool:
        """The loop runs and every shard answers Health (an answer the shard watch records too)."""
        return self._loop_alive() and await self._watch.check()

    def _loop_alive(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    # ---- requests --------------------------------------------------------------------

    def validate_lengths(self, num_input_tokens: int, max_new_tokens: int | None, n: int) -> int:
        """Check a request's lengths against the limits (loom_router.contract.check_lengths)."""
        assert self.limits is not None
        return check_lengths(self.limits, num_input_tokens, max_new_tokens, n)

    def add(self, request: Submit, sink: Sink, grammar: Grammar | None = None, hold_blocks: bool = False) -> int:
        """Queue one request; its tokens and failure go to `sink`. Returns its group id.

        hold_blocks (n == 1): when it finishes, its blocks stay allocated in `held[group_id]`
        until `release_held(group_id)`; a cancelled or failed request holds nothing.
        Raises OverloadedError, UnavailableError, GenerationError, ValidationError.
        """
        n = len(request.choices)
        assert not hold_blocks or n == 1
        if self._draining:  # 503, as the frontends answer once they know: retry elsewhere, not later here
            raise shutting_down()
        if not self._loop_alive():
            raise GenerationError(f"the engine loop is not running: {_named(self._loop_error)}")
        if self._watch.down:
            raise UnavailableError("a shard is down; retry on another replica")
        if len(self._active) >= self.config.max_concurrent_requests:
            raise OverloadedError(f"Model is overloaded: {len(self._active)} requests in flight "
                                  f"(--max-concurrent-requests {self.config.max_concurrent_requests})")
        self.validate_lengths(len(request.prompt_ids), request.max_new_tokens, n)
        lora_id = self.adapters.resolve(request.adapter)  # NotFoundError (404) for an unknown name
        pooling = Pooling(request.pooling)
        if pooling is not Pooling.NONE and (n != 1 or grammar is not None or hold_blocks):
            raise ValidationError("an embedding request has one choice, no constraint and no snapshot")
        group_id = next(self._ids)
        group = SequenceGroup.create(
            group_id=group_id,
            prompt_ids=list(request.prompt_ids),
            samplings=request.choices,
            first_seq_id=group_id * self.config.max_n,
            prompt_logprobs=request.prompt_logprobs,
            lora_id=lora_id,
            pooling=pooling,
        )
        active = _Active(group, request, sink, n, time.monotonic(), [None], hold_blocks)
        if grammar is not None:
            active.matchers = {seq.seq_id: grammar.new_matcher() for seq in group.seqs}
            self._constrained.add(group_id)
        self._active[group_id] = active
        if request.adapter is not None:
            counters = self._counters
            counters.adapter_requests[request.adapter] = counters.adapter_requests.get(request.adapter, 0) + 1
            prompt = counters.adapter_prompt_tokens
            prompt[request.adapter] = prompt.get(request.adapter, 0) + len(request.prompt_ids)
        self._pending_adds.append(group)
        self._wakeup.set()
        return group_id

    def _adapter_in_use(self, lora_id: int) -> bool:
        """Whether a request that is not finished runs with this adapter."""
        return any(active.group.lora_id == lora_id for active in self._active.values())

    def cancel(self, group_id: int, outcome: str = "cancelled") -> None:
        """The client went away (or the drain ran out of time): free its blocks before the next step."""
        if group_id in self._active:
            self._pending_aborts[group_id] = outcome
            self._wakeup.set()

    def cancel_all_of(self, sink: Sink, outcome: str) -> list[int]:
        """Cancel every request whose tokens go to `sink` (a frontend that is gone); their ids."""
        group_ids = [group_id for group_id, active in self._active.items() if active.sink is sink]
        for group_id in group_ids:
            self.cancel(group_id, outcome)
        return group_ids

    def stop_choice(self, group_id: int, index: int, num_generated: int) -> None:
        """A frontend found a stop string in choice `index`: it ends there (between steps)."""
        if group_id in self._active:
            self._pending_stops.append((group_id, index, num_generated))
            self._wakeup.set()

    def run_between_steps(self, fn: Callable[[Scheduler], T]) -> asyncio.Future[T]:
        """Run fn(scheduler) in the loop, before the next schedule(); its result (or
        exception) comes back on the future. A future cancelled before then skips fn."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        if not self._loop_alive():
            future.set_exception(GenerationError(f"the engine loop is not running: {_named(self._loop_error)}"))
            return future
        self._between_steps.append((fn, future))  # type: ignore[arg-type]
        self._wakeup.set()
        return future

    def release_held(self, group_id: int) -> None:
        """Give back the blocks a hold_blocks request kept (between steps; idempotent)."""
        seq = self.held.pop(group_id, None)
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
                    if self._watch.down:  # no step into a dead or frozen shard: wait until it answers
                        await self._watch.wait_up()
                    self._apply_pending()
                    self._run_between_steps()
                    plan = self.scheduler.schedule()
                    if plan is None:
                        self._wakeup.clear()
                        if not (self._pending_adds or self._pending_aborts or self._pending_stops or self._between_steps):
                            self._after_no_work = True
                            await self._wakeup.wait()
                        continue
                    if not self._prepare(plan):
                        continue
                    if not self.overlap_steps:
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
            self._fail_all(GenerationError(f"engine loop crashed: {_named(err)}"))
            self._status_changed()
            if self.on_fatal is not None:
                self.on_fatal(err)  # the process exits non-zero: the launcher tears everything down
            raise
        finally:
            for step in (inflight, ahead):
                if step is not None:
                    step.task.cancel()

    def _send_ahead(self, plan: StepPlan) -> InFlight | None:
        """Send the step after `plan` now, if it can be planned before plan's outputs (see lookahead)."""
        if self._pending_aborts or self._pending_stops or self._between_steps:
            return None  # they change what runs: apply them between two steps, as without lookahead
        assert self.scheduler is not None
        self._apply_pending()  # new requests: admitted into the step ahead when they fit
        ahead = plan_ahead(self.scheduler, plan, self._ahead_role)
        if ahead is None or not self._prepare(ahead):
            return None
        self._counters.steps_planned_ahead += 1
        return InFlight(ahead, asyncio.ensure_future(self._call(ahead)))

    def _prepare(self, plan: StepPlan) -> bool:
        """Get a planned step ready to send: queue times end, grammar masks are filled. A request
        the step cannot carry (a value protobuf cannot encode, a grammar that cannot go on) is
        withdrawn from it and fails alone. False when nothing is left to send."""
        self._withdraw(plan, {request_id: f"the request cannot be sent to the shards: {reason}"
                              for request_id, reason in unencodable_requests(plan).items()})
        self._mark_scheduled(plan)
        if self._has_constrained():
            self._withdraw(plan, {seq_id: f"{CONSTRAINT_FAILED}: {reason}"
                                  for seq_id, reason in self._masks.fill(plan, self._matcher_of).items()})
        return bool(plan.num_requests or plan.released_ids or plan.swap_in or plan.swap_out)

    def _has_constrained(self) -> bool:
        """Does any request still running carry a grammar (no mask to fill otherwise)?"""
        if self._constrained:
            self._constrained.intersection_update(self._active)
        return bool(self._constrained)

    def _withdraw(self, plan: StepPlan, reasons: dict[int, str]) -> None:
        """Take the groups of these sequences out of the unsent plan and fail each alone."""
        if not reasons:
            return
        assert self.scheduler is not None
        failures = {self._group_of(seq_id): reason for seq_id, reason in reasons.items()}
        log.warning("requests %s withdrawn from a step: %s", sorted(failures), sorted(set(failures.values())))
        self.scheduler.withdraw(plan, failures.keys())
        for group_id, reason in failures.items():
            self._fail(group_id, GenerationError(reason))

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
        if self._late and any(late is seq for late in self._late):
            return AheadRole.SKIP  # finished; its step-late release is pending
        if active is None or active.hold_blocks or active.matchers or active.group.pooling is not Pooling.NONE:
            return AheadRole.BLOCK  # held blocks must not hold an extra token; grammars need each token
        if seq.num_generated + 1 >= active.request.max_new_tokens:
            return AheadRole.SKIP  # the step in flight samples its last token
        return AheadRole.RUN

    def _apply_pending(self) -> None:
        assert self.scheduler is not None
        for group_id, outcome in self._pending_aborts.items():
            active = self._active.pop(group_id, None)
            if active is None:
                continue
            if active.group in self._pending_adds:
                self._pending_adds.remove(active.group)
            else:
                self.scheduler.abort(group_id)
            self._count_finish(outcome)
        self._pending_aborts.clear()
        for group_id, index, _ in self._pending_stops:
            active = self._active.get(group_id)
            if active is not None and not active.group.seqs[index].is_finished:
                self._finish(active, active.group.seqs[index], FinishReason.STOP)
        self._pending_stops.clear()
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
        after_no_work, self._after_no_work = self._after_no_work, False
        self._watch.step_started()
        try:
            with self._step_span(plan):
                result = await self.client.step(plan)
        except ShardDivergence:
            raise
        except Exception as err:
            self._observe_step(plan, time.perf_counter() - start, None)
            return err
        finally:
            self._watch.step_ended()
        self._counters.steps += 1
        self._observe_step(plan, time.perf_counter() - start, result, after_no_work)
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
            self._fail(group_id, GenerationError(f"Request failed during generation: {client_text(err)}"))
        await self._check_shards_after(err)  # the streams got their error first

    async def _check_shards_after(self, err: Exception) -> None:
        """A shard that is unreachable, or fails Health after a failed step, is down: new
        requests then get 503 at the door (loom_router.frontend.guard) and no step runs until the shards
        answer again (loom_router.core.shard_watch)."""
        down = isinstance(err, ShardError) and err.code == "UNAVAILABLE"
        if not down:
            try:
                down = not await self.client.health()
            except Exception:
                down = True
        if down and self.scheduler is not None:
            self._watch.mark_down(f"a step failed: {err}")
            # Requests admitted meanwhile (and any still running) cannot run either: 503, not 424.
            self._abort_all(self.scheduler, UnavailableError(f"a shard is down ({client_text(err)}); retry on another replica"))


def _named(error: BaseException | None) -> str:
    """An internal error for a client: its type and its text without paths or addresses."""
    return f"{type(error).__name__}: {client_text(error)}"
