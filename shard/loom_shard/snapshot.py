"""One shard's snapshot part files: save its rank's KV part, verify and stage loads until
the step thread fills them (the format itself is the contract's: loom_proto.snapshot)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loom_proto.snapshot import (
    KVLayout,
    PartHeader,
    SnapshotError,
    SnapshotStatus,
    check_part,
    part_name,
    read_part,
    resolve_inside,
    write_part,
)

MAX_STAGED_LOADS = 8  # loads verified but never filled (a router that died meanwhile)


@dataclass(slots=True)
class LoadedPart:
    header: PartHeader
    kv: memoryview
    num_bytes: int


class PartStore:
    """One shard's part files and the loads it verified but has not filled yet.

    Called from an I/O thread (never the step thread): reading, hashing and writing
    whole files there lets steps continue.
    """

    def __init__(self, root: Path | None, rank: int, world_size: int) -> None:
        self.root = root
        self.rank = rank
        self.world_size = world_size
        self._loaded: OrderedDict[str, LoadedPart] = OrderedDict()
        self._lock = threading.Lock()

    def folder(self, dir_name: str) -> Path:
        if self.root is None:
            raise SnapshotError(SnapshotStatus.DISABLED, "this shard has no snapshot directory (--snapshot-dir)")
        return resolve_inside(self.root, dir_name)

    def save(self, dir_name: str, fingerprint: dict[str, Any], token_ids: list[int],
             layout: KVLayout, kv: memoryview) -> int:
        """Write this rank's part into an existing folder; returns its size in bytes."""
        folder = self.folder(dir_name)
        if not folder.is_dir():
            raise SnapshotError(SnapshotStatus.NOT_FOUND, f"folder {dir_name!r} does not exist")
        header = PartHeader(fingerprint, list(token_ids), layout, self.rank, self.world_size)
        return write_part(folder / part_name(self.rank), header, kv)

    def load(self, dir_name: str, load_id: str, fingerprint: dict[str, Any]) -> LoadedPart:
        """Read, verify and keep this rank's part under load_id."""
        path = self.folder(dir_name) / part_name(self.rank)
        header, kv = read_part(path)
        check_part(header, fingerprint, self.rank, self.world_size)
        loaded = LoadedPart(header, kv, path.stat().st_size)
        with self._lock:
            self._loaded[load_id] = loaded
            while len(self._loaded) > MAX_STAGED_LOADS:
                self._loaded.popitem(last=False)
        return loaded

    def take(self, load_id: str) -> LoadedPart | None:
        with self._lock:
            return self._loaded.pop(load_id, None)
