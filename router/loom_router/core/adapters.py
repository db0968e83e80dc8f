"""The LoRA adapters the engine core serves: names -> the numbers the shards know them by.

Loading asks every rank to read and check the adapter; when one refuses, the ranks that took it
forget it again, and the registry is unchanged (HTTP 400 with the rank's reason). Unloading
takes the name away at once (new requests get 404), then waits until no request that named it
is still running before the shards forget it, so no step ever names an adapter a shard lacks.
Numbers are never reused, so prefix-cache entries of an unloaded adapter can never be hit by
another one loaded later under the same name.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from loom_router.core.request import lora_hash_root
from loom_router.types import BadRequestError, NotFoundError

UNLOAD_POLL_S = 0.05
IDENTITY_SEPARATOR = "@sha256:"


def name_of(identity: str) -> str:
    """The adapter name in an `Adapter.identity`."""
    return identity.rpartition(IDENTITY_SEPARATOR)[0]


class LoraBackend(Protocol):
    async def load_lora(self, lora_id: int, path: str) -> list[tuple[bool, str, str]]: ...
    async def unload_lora(self, lora_id: int) -> None: ...


@dataclass(slots=True, frozen=True)
class Adapter:
    name: str
    lora_id: int
    path: str
    digest: str = ""  # sha256 of its files, as the shards read them

    @property
    def identity(self) -> str:
        """What a KV snapshot computed with it records: its name and its files' digest."""
        return f"{self.name}{IDENTITY_SEPARATOR}{self.digest}"

    @property
    def hash_root(self) -> int:
        """The parent hash of its sequences' first KV block (loom_router.core.request.Sequence.hash_root)."""
        return lora_hash_root(self.lora_id)


class AdapterRegistry:
    """Adapter names, loaded on every shard rank. `in_use(lora_id)`: whether a request still runs with it."""

    def __init__(self, client: LoraBackend, enabled: bool, in_use: Callable[[int], bool]) -> None:
        self.enabled = enabled
        self._client = client
        self._in_use = in_use
        self._by_name: dict[str, Adapter] = {}
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()  # one load or unload at a time: names stay consistent

    def list(self) -> list[Adapter]:
        return list(self._by_name.values())

    def resolve(self, name: str | None) -> int | None:
        """The shards' number for an adapter name (None: the base model). Raises NotFoundError."""
        if name is None:
            return None
        return self.get(name).lora_id

    def get(self, name: str) -> Adapter:
        """The adapter loaded under name. Raises NotFoundError."""
        adapter = self._by_name.get(name)
        if adapter is None:
            raise NotFoundError(f"The model `{name}` does not exist.")
        return adapter

    def by_identity(self, identity: str) -> Adapter | None:
        """The loaded adapter with this identity (`Adapter.identity`): same name, same files."""
        adapter = self._by_name.get(name_of(identity))
        return adapter if adapter is not None and adapter.identity == identity else None

    async def load(self, name: str, path: str) -> Adapter:
        """Load on every rank. Raises BadRequestError (nothing changed)."""
        if not self.enabled:
            raise BadRequestError("LoRA is off: start the server with --enable-lora or --lora-adapter")
        if not name or not path:
            raise BadRequestError("`lora_name` and `lora_path` are required")
        async with self._lock:
            if name in self._by_name:
                raise BadRequestError(f"The lora adapter '{name}' has already been loaded.")
            lora_id = next(self._ids)
            replies = await self._client.load_lora(lora_id, path)
            refusals = [message for ok, message, _ in replies if not ok]
            if refusals:
                if any(ok for ok, _, _ in replies):
                    await self._client.unload_lora(lora_id)
                raise BadRequestError(f"adapter '{name}' cannot be loaded: {refusals[0]}")
            adapter = Adapter(name, lora_id, path, replies[0][2])
            self._by_name[name] = adapter
            return adapter

    async def unload(self, name: str) -> None:
        """Take the name away, wait for its running requests, then free it on the shards."""
        async with self._lock:
            adapter = self._by_name.pop(name, None)
            if adapter is None:
                raise NotFoundError(f"The lora adapter '{name}' cannot be found.")
            while self._in_use(adapter.lora_id):
                await asyncio.sleep(UNLOAD_POLL_S)
            await self._client.unload_lora(adapter.lora_id)

    async def load_all(self, specs: Sequence[str]) -> None:
        """--lora-adapter NAME=PATH, each in turn. Raises BadRequestError on the first that fails."""
        for spec in specs:
            name, _, path = spec.partition("=")
            await self.load(name.strip(), path.strip())
