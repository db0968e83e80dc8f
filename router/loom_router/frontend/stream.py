"""What `Engine.submit` returns: one request's events, as an async iterator with a cancel."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from loom_router.core.request import Sequence
from loom_router.types import ChoiceEvent, GenerationError, PromptInfo

DONE = object()  # the stream's end marker


class GenerationStream:
    """The events of one request's n choices, interleaved, as the engine produces them."""

    def __init__(self, on_cancel: Callable[[int], None], group_id: int, num_prompt_tokens: int,
                 max_buffered: int | None = None) -> None:
        self._on_cancel = on_cancel
        # A client that does not read must not grow the router's memory: past this many
        # unread events the request is cancelled (None: unbounded).
        self.max_buffered = max_buffered
        self.overflowed = False
        self.group_id = group_id
        self.prompt = PromptInfo(num_prompt_tokens=num_prompt_tokens)
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self.closed = False
        # With hold_blocks: the finished sequence, still holding its blocks until
        # `Engine.release_held` (its KV stays valid for a snapshot to copy).
        self.held: Sequence | None = None
        # For the metrics and the request log (perf_counter seconds):
        self.submitted_at = time.perf_counter()
        self.scheduled_at: float | None = None  # set by the engine's first step that runs it
        self.max_new_tokens: int | None = None
        self.outcome: str | None = None  # the last finish reason, "cancelled" or "error"

    def put(self, item: object) -> None:
        if self.overflowed:
            return
        if isinstance(item, ChoiceEvent) and self.max_buffered is not None \
                and self._queue.qsize() >= self.max_buffered:
            self.overflowed = True
            self._queue.put_nowait(GenerationError(
                f"the client read too slowly: {self.max_buffered} events unread, request cancelled "
                "(--stream-buffer-events)"))
            self._on_cancel(self.group_id)
            return
        self._queue.put_nowait(item)

    async def __aiter__(self) -> AsyncIterator[ChoiceEvent]:
        while True:
            item = await self._queue.get()
            if item is DONE:
                return
            if isinstance(item, Exception):
                raise item
            assert isinstance(item, ChoiceEvent)
            yield item

    def cancel(self) -> None:
        """The client went away: free its blocks before the next step."""
        if not self.closed:
            self._on_cancel(self.group_id)
