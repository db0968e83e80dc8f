"""What the engine core has for one frontend, sent as about one message per step.

Outputs of a step collect in an open Batch, merged per choice; the batch goes out when the loop
turn ends (`flush`, scheduled once by the first output). While the frontend is behind (its socket
full), the open batch stays open and keeps merging: its tokens then reach the frontend together,
in order, never dropped. Admissions and replies close the open batch first, so that a frontend
always sees a request's Admitted before that request's first output.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

from loom_router.contract import Batch, Failure, Output, PromptInfo, Status, encoder
from loom_router.ipc import Sender


class Outbox:
    """Messages for one frontend, sent in order; outputs merge while the frontend is behind."""

    def __init__(self, frontend: int, sender: Sender | None = None) -> None:
        self.frontend = frontend
        self._sender = sender
        self._queue: deque[Any] = deque()  # messages not handed to the socket yet; the last may be open
        self._open: Batch | None = None
        self._by_choice: dict[tuple[int, int], Output] = {}
        self._scheduled = False
        self._closed = False  # the frontend is gone: what its requests still produce goes nowhere
        self._loop = asyncio.get_running_loop()

    def attach(self, sender: Sender) -> None:
        self._sender = sender
        self._schedule()

    # ---- what the engine puts in --------------------------------------------------------

    def token(self, group_id: int, index: int, token_id: int, logprob: float, num_generated: int,
              finish: str | None, top_tokens: list[tuple[int, float]] | None, prompt: PromptInfo | None) -> None:
        """One new token of choice `index` of request `group_id`."""
        if self._closed:
            return
        key = (group_id, index)
        output = self._by_choice.get(key)
        if output is None:
            batch = self._batch()
            output = Output(group_id, index, [token_id], [logprob], num_generated, finish,
                            None if top_tokens is None else [top_tokens], prompt)
            batch.outputs.append(output)
            self._by_choice[key] = output
            return
        output.token_ids.append(token_id)
        output.logprobs.append(logprob)
        output.num_generated = num_generated
        output.finish = finish
        if top_tokens is not None:
            output.top_tokens = (output.top_tokens or []) + [top_tokens]
        if prompt is not None:
            output.prompt = prompt

    def embedding(self, group_id: int, vector: list[float], prompt: PromptInfo) -> None:
        """An embedding request's pooled vector: it is done."""
        if not self._closed:
            self._batch().outputs.append(Output(group_id, 0, [], [], 0, "length", None, prompt, vector))

    def fail(self, group_id: int, status: int, message: str) -> None:
        if not self._closed:
            self._batch().failures.append(Failure(group_id, status, message))

    def status(self, status: Status) -> None:
        if not self._closed:
            self._batch().status = status

    def message(self, message: Any) -> None:
        """An Admitted, Refused or Reply: after every output already queued."""
        if self._closed:
            return
        self._close_batch()
        self._queue.append(message)
        self._schedule()

    # ---- sending --------------------------------------------------------------------------

    def flush(self) -> None:
        """Hand everything to the socket, unless the frontend is still behind: then the open
        batch stays open (it merges the next steps' outputs) until the socket drains."""
        self._scheduled = False
        sender = self._sender
        if sender is None or sender.backlogged:
            return
        self._close_batch()
        while self._queue:
            sender.send(encoder.encode(self._queue.popleft()))

    def close(self) -> None:
        self._closed = True
        if self._sender is not None:
            self._sender.close()
        self._sender = None
        self._queue.clear()
        self._close_batch()

    @property
    def pending(self) -> bool:
        return bool(self._queue) or self._open is not None

    def _batch(self) -> Batch:
        if self._open is None:
            self._open = Batch(outputs=[], failures=[])
            self._queue.append(self._open)
            self._schedule()
        return self._open

    def _close_batch(self) -> None:
        self._open = None
        self._by_choice.clear()

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.flush)
