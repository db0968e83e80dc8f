"""One request's stream in a frontend: the engine core's token ids become ChoiceEvents here.

Each choice has its incremental detokenizer and stop matcher (loom_router.frontend.text); a stop
string ends the choice where its text is, and the core is told at once to stop computing it.
The engine client feeds a whole step's outputs at a time; the handler that writes the response
takes every event waiting at once (`take`), so a client, or a handler, that falls behind gets
the tokens it has not sent yet together in its next write, in order, never dropped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from loom_proto.step import TokenLogprob
from loom_router.contract import Output
from loom_router.frontend.text import IncrementalDetokenizer, StopMatcher
from loom_router.tokenizer import Tokenizer
from loom_router.types import (
    ChoiceEvent,
    FinishReason,
    GeneratedToken,
    GenerationError,
    GenerationParams,
    PromptInfo,
    error_for_status,
)

FINISH = {reason.value: reason for reason in FinishReason}


@dataclass(slots=True)
class _Choice:
    detokenizer: IncrementalDetokenizer
    stop: StopMatcher
    finished: bool = False
    last_at: float | None = None  # when its last tokens arrived (the inter-token latency)


class GenerationStream:
    """The events of one request's n choices, interleaved, as the engine core produces them."""

    def __init__(self, group_id: int, tokenizer: Tokenizer, prompt_ids: list[int], params: GenerationParams,
                 on_cancel: Callable[[int, str], None], on_stop: Callable[[int, int, int], None],
                 turn: Callable[[], int] = lambda: 0, max_buffered: int | None = None,
                 stream_interval: int = 1) -> None:
        self.group_id = group_id
        self._tokenizer = tokenizer
        self._special_ids = tokenizer.special_ids
        self._on_cancel = on_cancel
        self._on_stop = on_stop
        self._choices = [_Choice(IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens),
                                 StopMatcher(params.stop_sequences, params.stop_text)) for _ in range(params.n)]
        # With specials kept (a tool-call marker), the EOS that ends the answer is still no text.
        self._silent_ids = frozenset() if params.skip_special_tokens or params.ignore_eos \
            else frozenset(tokenizer.eos_token_ids)
        self._num_open = params.n
        # A client that does not read must not grow the router's memory: past this many events
        # left unread (by a handler that had its turn to take them) the request is cancelled
        # (None: unbounded). What arrives together is never held against it.
        self.max_buffered = max_buffered
        self._turn = turn  # the engine client's delivery count
        self._last_turn = -1
        self._num_unread = 0  # events that were waiting before this turn's deliveries
        self.overflowed = False
        self._interval = stream_interval  # tokens a choice collects before its handler wakes (the first: at once)
        self._events: list[ChoiceEvent] = []
        self._num_new = 0  # tokens taken in since the handler last woke
        self._error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.closed = False  # every choice finished, or the request failed or was cancelled
        self.prompt = PromptInfo(num_prompt_tokens=len(prompt_ids))
        self.max_new_tokens: int | None = params.max_new_tokens
        # For the metrics and the request log (time.monotonic seconds):
        self.submitted_at = time.monotonic()
        self.scheduled_at: float | None = None
        self.outcome: str | None = None  # the last finish reason, "cancelled" or "error"
        self.on_tokens: Callable[[int, int, float, float | None], None] | None = None  # (choice, count, now, gap)

    # ---- fed by the engine client ----------------------------------------------------------

    def feed(self, output: Output, now: float) -> None:
        """A step's new tokens of one choice (several when steps merged or drafts were verified)."""
        choice = self._choices[output.index]
        if choice.finished:
            return  # tokens computed before the core learnt of a stop string: never sent
        if output.prompt is not None:
            self._take_prompt(output)
        token_ids = output.token_ids
        first_generated = output.num_generated - len(token_ids) + 1
        last = len(token_ids) - 1
        finished = False
        for i, token_id in enumerate(token_ids):
            top = output.top_tokens[i] if output.top_tokens is not None else None
            event = self._event(choice, output.index, token_id, output.logprobs[i], top,
                                output.finish if i == last else None, first_generated + i)
            self._events.append(event)
            if event.finish_reason is not None:
                self._close_choice(choice, event)
                finished = True
                break
        if self.on_tokens is not None:
            gap = None if choice.last_at is None else now - choice.last_at
            self.on_tokens(output.index, len(token_ids), now, gap)
        choice.last_at = now
        self._num_new += len(token_ids)
        if self._over_bound() and not self.closed:
            self._overflow()
        elif finished or first_generated == 1 or self._num_new >= self._interval:
            self._wake()  # the first token and a choice's end go at once; the rest every `interval`

    def fail(self, status: int, message: str) -> None:
        if not self.closed:
            self._end(error_for_status(status, message), "error")

    def _take_prompt(self, output: Output) -> None:
        prompt = output.prompt
        assert prompt is not None
        self.prompt.num_cached_tokens = prompt.num_cached_tokens
        self.prompt.prompt_logprobs = prompt.prompt_logprobs
        self.prompt.prompt_top_tokens = [None if top is None else [TokenLogprob(t, lp) for t, lp in top]
                                         for top in prompt.prompt_top_tokens]
        self.scheduled_at = prompt.scheduled_at

    def _event(self, choice: _Choice, index: int, token_id: int, logprob: float,
               top: list[tuple[int, float]] | None, core_finish: str | None, num_generated: int) -> ChoiceEvent:
        """Detokenize one token and decide whether it ends the choice (a stop string here, EOS or
        length from the core)."""
        # the text this token adds (TGI's token.text)
        delta = "" if token_id in self._silent_ids else choice.detokenizer.add(token_id)
        emitted, stopped = choice.stop.feed(delta)
        reason = FinishReason.STOP if stopped else FINISH[core_finish] if core_finish is not None else None
        if reason is not None and reason is not FinishReason.STOP:
            held = choice.detokenizer.flush()
            delta += held
            tail, stopped = choice.stop.feed(held)
            emitted += tail if stopped else tail + choice.stop.flush()
            reason = FinishReason.STOP if stopped else reason
        tops = [TokenLogprob(t, lp) for t, lp in top] if top else []
        token = GeneratedToken(token_id, delta, logprob, token_id in self._special_ids, tops)
        return ChoiceEvent(index, token, emitted, reason, num_generated)

    def _close_choice(self, choice: _Choice, event: ChoiceEvent) -> None:
        choice.finished = True
        self._num_open -= 1
        assert event.finish_reason is not None
        if event.finish_reason is FinishReason.STOP:
            self._on_stop(self.group_id, event.index, event.num_generated)  # the core stops computing it
        if self._num_open == 0:
            self._end(None, event.finish_reason.value)

    def _over_bound(self) -> bool:
        if self.max_buffered is None or len(self._events) < self.max_buffered:
            return False
        waiter = self._waiter
        # A handler that waits, or was woken this turn and has not run yet, is keeping up.
        return waiter is None or (waiter.done() and self._woken_turn != self._turn())

    def _overflow(self) -> None:
        self.overflowed = True
        self._events.clear()
        self._end(GenerationError(f"the client read too slowly: {self.max_buffered} events unread, request "
                                  "cancelled (--stream-buffer-events)"), "cancelled")
        self._on_cancel(self.group_id, "cancelled")

    def _end(self, error: Exception | None, outcome: str) -> None:
        self.closed = True
        self._error = error
        self.outcome = outcome
        self._wake()

    def _wake(self) -> None:
        self._num_new = 0
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
            self._woken_turn = self._turn()

    # ---- read by the HTTP handler -----------------------------------------------------------

    async def take(self) -> list[ChoiceEvent]:
        """Every event waiting (at least one), in order; [] once the stream ended. Raises the
        request's error (GenerationError, UnavailableError) after its last events."""
        while not self._events:
            if self.closed:
                if self._error is not None:
                    error, self._error = self._error, None
                    raise error
                return []
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
            self._waiter = None
        events, self._events = self._events, []
        return events

    async def __aiter__(self) -> AsyncIterator[ChoiceEvent]:
        while events := await self.take():
            for event in events:
                yield event

    def cancel(self) -> None:
        """The client went away: free its blocks before the next step."""
        if not self.closed:
            self.closed = True
            self.outcome = "cancelled"
            self._on_cancel(self.group_id, "cancelled")
            self._wake()
