"""The KV snapshot format, part of the contract: the part file's bytes (magic, version,
header, KV bytes, checksum), the manifest, the model fingerprint and the status codes.
Pure data, no file I/O: the shards read and write the files (loom_shard.runtime.snapshot), the
router decides what to save and reads manifests through the shards. Torch-free.

    <snapshot dir>/<name>/manifest.json   format version, shard count, tokens, fingerprint
    <snapshot dir>/<name>/rank-<r>.kv     MAGIC | u32 version | u32 header length |
                                          header JSON | KV bytes | sha256 of all before it

The KV is laid out [num_layers, 2 (k, v), num_tokens, num_kv_heads, head_dim] (this rank's
heads), independent of the block size and of the shard's cache layout. A folder is built as
`.staging-*` and renamed into place, so a snapshot is complete or absent.
"""

from __future__ import annotations

import enum
import hashlib
import json
import struct
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from loom_proto.step import ModelInfo

MAGIC = b"LOOMKV\r\n"  # \r\n: a text-mode copy that mangles line ends is caught at once
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MANIFEST_KIND = "loom-kv-snapshot"
STAGING_PREFIX = ".staging-"
TRASH_PREFIX = ".trash-"
_PREFIX = struct.Struct("<II")  # format version, header length
_CHECKSUM_BYTES = 32  # sha256 (hardware-accelerated here: ~2x blake2b's speed)
_MIN_PART_BYTES = len(MAGIC) + _PREFIX.size + _CHECKSUM_BYTES
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class SnapshotStatus(enum.Enum):
    OK = "ok"
    NOT_FOUND = "not_found"
    DAMAGED = "damaged"  # truncated, altered, unreadable
    MISMATCH = "mismatch"  # intact, but for another model, dtype, format version or shard count
    INVALID = "invalid"  # the request is wrong (a name outside the folder, bad blocks)
    DISABLED = "disabled"  # no snapshot directory configured
    FAILED = "failed"  # anything else (disk full, I/O error)


@dataclass(slots=True)
class SnapshotReply:
    """One rank's answer to a snapshot RPC."""

    status: SnapshotStatus
    message: str = ""
    num_bytes: int = 0
    token_ids: list[int] = field(default_factory=list)


class SnapshotError(Exception):
    def __init__(self, status: SnapshotStatus, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def model_fingerprint(info: ModelInfo, tokenizer_hash: str, adapter: str = "") -> dict[str, Any]:
    """What a snapshot must agree with to be restored: the model, its dtype and quantization
    (weights kept quantized compute other KV values than dequantized ones), its tokenizer, and the
    LoRA adapter its KV was computed with ("name@sha256:digest"; None: the base model, as in
    snapshots written before adapters were recorded)."""
    return {
        "architecture": info.architecture, "num_layers": info.num_layers, "num_heads": info.num_heads,
        "num_kv_heads": info.num_kv_heads, "head_dim": info.head_dim, "hidden_size": info.hidden_size,
        "vocab_size": info.vocab_size, "dtype": info.dtype, "weights_hash": info.weights_hash,
        "quantization": info.quantization, "tokenizer_hash": tokenizer_hash, "adapter": adapter or None,
    }


def find_mismatch(expected: Mapping[str, Any], found: Mapping[str, Any]) -> str | None:
    """A sentence naming the first field that differs, or None when they agree."""
    for key in expected:
        if found.get(key) != expected[key]:
            return f"{key}: the snapshot has {found.get(key)!r}, the server {expected[key]!r}"
    return None


@dataclass(slots=True, frozen=True)
class KVLayout:
    """The shape of one part's KV bytes: [num_layers, 2, num_tokens, num_kv_heads, head_dim]."""

    num_layers: int
    num_tokens: int
    num_kv_heads: int  # held by this rank
    head_dim: int
    dtype: str

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.num_tokens, self.num_kv_heads, self.head_dim)

    @property
    def num_bytes(self) -> int:
        return self.num_layers * 2 * self.num_tokens * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]


@dataclass(slots=True)
class PartHeader:
    fingerprint: dict[str, Any]
    token_ids: list[int]
    layout: KVLayout
    rank: int
    world_size: int

    def to_json(self) -> bytes:
        return json.dumps({**asdict(self), "layout_order": "layers,kv,tokens,kv_heads,head_dim"}).encode()

    @classmethod
    def from_json(cls, data: bytes) -> PartHeader:
        raw = json.loads(data)
        layout = KVLayout(**raw["layout"])
        header = cls(dict(raw["fingerprint"]), [int(t) for t in raw["token_ids"]], layout,
                     int(raw["rank"]), int(raw["world_size"]))
        if layout.dtype not in DTYPE_BYTES or len(header.token_ids) != layout.num_tokens:
            raise ValueError("inconsistent layout")
        return header


def part_name(rank: int) -> str:
    return f"rank-{rank}.kv"


def part_chunks(header: PartHeader, kv: memoryview) -> Iterator[bytes | memoryview]:
    """A part file's bytes in order, the checksum last; kv is header.layout's bytes."""
    if kv.nbytes != header.layout.num_bytes:
        raise SnapshotError(SnapshotStatus.INVALID, f"{kv.nbytes} KV bytes for a layout of {header.layout.num_bytes}")
    digest = hashlib.sha256()
    header_bytes = header.to_json()
    for chunk in (MAGIC, _PREFIX.pack(FORMAT_VERSION, len(header_bytes)), header_bytes, kv.cast("B")):
        digest.update(chunk)
        yield chunk
    yield digest.digest()


def parse_part(data: bytearray, name: str) -> tuple[PartHeader, memoryview]:
    """Verify a whole part file's bytes: magic, checksum, version, header. Returns the header
    and its KV bytes (a writable view). Raises SnapshotError (DAMAGED, MISMATCH)."""
    if len(data) < _MIN_PART_BYTES:
        raise SnapshotError(SnapshotStatus.DAMAGED, f"part file {name} is damaged: truncated")
    view = memoryview(data)
    if view[:len(MAGIC)] != MAGIC:
        raise SnapshotError(SnapshotStatus.DAMAGED, f"part file {name} is damaged: not a Loom KV snapshot")
    # The checksum covers everything and sits at the end in every version: check it first,
    # so any altered byte (the version field included) reads as damage.
    if hashlib.sha256(view[:-_CHECKSUM_BYTES]).digest() != view[-_CHECKSUM_BYTES:]:
        raise SnapshotError(SnapshotStatus.DAMAGED, f"part file {name} is damaged: checksum mismatch")
    version, header_len = _PREFIX.unpack_from(view, len(MAGIC))
    if version != FORMAT_VERSION:
        raise SnapshotError(SnapshotStatus.MISMATCH,
                            f"format version: the snapshot has {version}, the server reads {FORMAT_VERSION}")
    start = len(MAGIC) + _PREFIX.size
    try:
        header = PartHeader.from_json(bytes(view[start:start + header_len]))
    except (ValueError, KeyError, TypeError) as error:
        raise SnapshotError(SnapshotStatus.DAMAGED, f"part file {name} is damaged: bad header ({error})") from None
    kv = view[start + header_len:-_CHECKSUM_BYTES]
    if kv.nbytes != header.layout.num_bytes:
        raise SnapshotError(SnapshotStatus.DAMAGED,
                            f"part file {name} is damaged: {kv.nbytes} KV bytes, expected {header.layout.num_bytes}")
    return header, kv


def check_part(header: PartHeader, fingerprint: Mapping[str, Any], rank: int, world_size: int) -> None:
    """Raise MISMATCH unless the part was written for this model, dtype, rank and shard count."""
    if header.world_size != world_size:
        raise SnapshotError(SnapshotStatus.MISMATCH,
                            f"shard count: the snapshot has {header.world_size}, the server {world_size}")
    if header.rank != rank:
        raise SnapshotError(SnapshotStatus.MISMATCH, f"rank: the part has {header.rank}, this shard is {rank}")
    mismatch = find_mismatch(fingerprint, header.fingerprint)
    if mismatch is not None:
        raise SnapshotError(SnapshotStatus.MISMATCH, mismatch)


# ---- the manifest ----------------------------------------------------------------------------

TOKEN_ID_LIMIT = 2**32  # token ids cross the shard protocol as uint32


@dataclass(slots=True)
class Manifest:
    num_shards: int
    num_tokens: int
    fingerprint: dict[str, Any]
    parts: dict[str, int]  # part file name -> bytes
    created: float = field(default_factory=time.time)
    token_ids: list[int] = field(default_factory=list)  # lets DELETE find the cached blocks
    format_version: int = FORMAT_VERSION

    @property
    def num_bytes(self) -> int:
        return sum(self.parts.values())

    def to_json(self) -> bytes:
        return json.dumps({"kind": MANIFEST_KIND, **asdict(self)}, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes | str, name: str) -> Manifest:
        """The manifest of snapshot `name`; SnapshotError DAMAGED (also for a field of the wrong
        type or range: its token ids decide which cached blocks a DELETE drops) or MISMATCH."""
        try:
            raw = json.loads(data)
            if raw.pop("kind") != MANIFEST_KIND:
                raise ValueError("not a Loom KV snapshot manifest")
            manifest = cls(**raw)
            if manifest.format_version == FORMAT_VERSION:
                manifest._check_fields()
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise SnapshotError(SnapshotStatus.DAMAGED, f"snapshot {name!r} is damaged: manifest: {error}") from None
        if manifest.format_version != FORMAT_VERSION:
            raise SnapshotError(SnapshotStatus.MISMATCH, f"format version: the snapshot has "
                                f"{manifest.format_version}, the server reads {FORMAT_VERSION}")
        return manifest

    def _check_fields(self) -> None:
        """ValueError unless every field has its type and range (JSON's own types say little)."""
        if not (_is_int(self.num_shards) and self.num_shards >= 1 and _is_int(self.num_tokens)):
            raise ValueError("num_shards and num_tokens must be counts")
        if not isinstance(self.fingerprint, dict) or not isinstance(self.parts, dict):
            raise ValueError("fingerprint and parts must be objects")
        if not all(isinstance(k, str) and _is_int(v) and v >= 0 for k, v in self.parts.items()):
            raise ValueError("parts must map file names to byte counts")
        if not isinstance(self.created, (int, float)) or isinstance(self.created, bool):
            raise ValueError("created must be a time")
        tokens = self.token_ids
        if not isinstance(tokens, list) or not all(_is_int(t) and 0 <= t < TOKEN_ID_LIMIT for t in tokens):
            raise ValueError(f"token_ids must be token ids (0..{TOKEN_ID_LIMIT - 1})")
        if len(tokens) != self.num_tokens:
            raise ValueError(f"{len(tokens)} token_ids for num_tokens {self.num_tokens}")


def _is_int(value: object) -> bool:
    return type(value) is int  # not a bool


@dataclass(slots=True)
class SnapshotEntry:
    """One snapshot folder as listed: its manifest, or the error that keeps it unreadable."""

    name: str
    manifest: Manifest | None
    error: SnapshotError | None = None
