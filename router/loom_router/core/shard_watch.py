"""Whether the shards can take work, known without waiting for a request to find out.

A shard that died fails the step it was in; one that froze (SIGSTOP, a hung driver) holds it
forever. Either way new requests must be refused at once (503), not admitted to hang, and the
engine must not step into a dead shard again and again. The watch asks the shards' Health:

- while a step has run longer than STALL_S (a long prefill still answers Health: its shard
  computes on a worker thread; a frozen one does not answer at all),
- every IDLE_PROBE_S while the engine is idle (a shard frozen between requests),
- and, once they are down, with a backoff from BACKOFF_MIN_S to BACKOFF_MAX_S until they answer
  again; the engine loop waits for that (`wait_up`) instead of stepping.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger("loom.engine")

WATCH_INTERVAL_S = 0.5
STALL_S = 1.0
IDLE_PROBE_S = 5.0
BACKOFF_MIN_S = 0.25
BACKOFF_MAX_S = 2.0


class ShardWatch:
    def __init__(self, health: Callable[[], Awaitable[bool]], on_change: Callable[[], None] | None = None) -> None:
        self._health = health
        self._on_change = on_change  # told when the shards go down or come back
        self._up = asyncio.Event()
        self._up.set()
        self._step_started: float | None = None
        self._last_probe = time.monotonic()
        self._backoff_s = BACKOFF_MIN_S
        self._next_probe = 0.0

    @property
    def down(self) -> bool:
        return not self._up.is_set()

    def step_started(self) -> None:
        self._step_started = time.monotonic()

    def step_ended(self) -> None:
        self._step_started = None

    def mark_down(self, reason: str) -> None:
        if not self.down:
            log.error("shards down (%s): new requests get 503; checking their health with backoff", reason)
            self._up.clear()
            self._backoff_s = BACKOFF_MIN_S
            self._next_probe = time.monotonic() + self._backoff_s
            if self._on_change is not None:
                self._on_change()

    def mark_up(self) -> None:
        if self.down:
            log.warning("the shards answer again: taking new requests")
            self._up.set()
            if self._on_change is not None:
                self._on_change()

    async def wait_up(self) -> None:
        await self._up.wait()

    async def check(self, reason: str = "Health does not answer") -> bool:
        """Ask the shards' Health now (also for /health and /ready: whoever learns first tells
        the rest); the answer marks them down or up."""
        self._last_probe = time.monotonic()
        try:
            healthy = await self._health()
        except Exception:  # noqa: BLE001 (a shard that cannot even be asked is not healthy)
            healthy = False
        if healthy:
            self.mark_up()
        else:
            self.mark_down(reason)
        return healthy

    async def run(self) -> None:
        """The watch itself: a task for the engine's lifetime."""
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            now = time.monotonic()
            if self.down:
                if now >= self._next_probe and not await self.check():
                    self._backoff_s = min(self._backoff_s * 2, BACKOFF_MAX_S)
                    self._next_probe = time.monotonic() + self._backoff_s
            elif self._step_started is not None and now - self._step_started > STALL_S:
                await self.check(f"a step has run {now - self._step_started:.1f} s and Health does not answer")
            elif self._step_started is None and now - self._last_probe > IDLE_PROBE_S:
                await self.check()
