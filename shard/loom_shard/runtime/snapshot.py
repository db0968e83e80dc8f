"""The shards' snapshot files: every byte in the snapshot directory is written here (parts,
manifest, folders), so a router on another host needs no shared filesystem. The format
itself is the contract's (loom_proto.snapshot).

    <snapshot dir>/<name>/manifest.json   written by rank 0 when it commits the folder
    <snapshot dir>/<name>/rank-<r>.kv     written by rank r
    <snapshot dir>/.staging-<id>/         a save in progress, renamed to <name> at commit

Called from an I/O thread (never the step thread): reading, hashing and writing whole files
there lets steps continue.

Confinement: names are NFC-normalised (two spellings of one name are one snapshot), and
symbolic links inside the directory are never followed: files are opened through a handle
on their folder taken with O_NOFOLLOW, so a folder swapped for a link after the name was
checked still receives (or gives) nothing outside. Case-insensitive filesystems (names that
differ only in case) are out of scope.
"""

from __future__ import annotations

import os
import shutil
import stat
import threading
import unicodedata
import uuid
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loom_proto.snapshot import (
    MANIFEST,
    STAGING_PREFIX,
    TRASH_PREFIX,
    KVLayout,
    Manifest,
    PartHeader,
    SnapshotEntry,
    SnapshotError,
    SnapshotStatus,
    check_part,
    parse_part,
    part_chunks,
    part_name,
)

MAX_STAGED_LOADS = 8  # loads verified but never filled (a router that died meanwhile)


# ---- files ---------------------------------------------------------------------------------


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_dir(path: Path) -> int:
    """A handle on the folder itself, refusing a symbolic link (OSError ELOOP or ENOTDIR):
    what goes through it stays in that folder even if its name is swapped afterwards."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)


def atomic_write(path: Path, chunks: Iterable[bytes | memoryview]) -> int:
    """Write chunks to path all at once or not at all: a temporary file in the same folder,
    fsync, rename, fsync the folder; all through one handle on the folder (see open_dir).
    Returns the bytes written."""
    tmp = f".{path.name}.tmp-{uuid.uuid4().hex}"
    dir_fd = open_dir(path.parent)
    size = 0
    try:
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=dir_fd)
            with open(fd, "wb") as f:
                for chunk in chunks:
                    size += f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except FileNotFoundError:
                pass
            raise
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return size


def read_confined(path: Path) -> bytes:
    """A regular file's bytes, neither it nor its folder a symbolic link (OSError otherwise;
    FileNotFoundError when missing). A fifo or device cannot block or flood the reader."""
    dir_fd = open_dir(path.parent)
    try:
        fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path.name} is not a regular file")
        return f.read()


def write_part(path: Path, header: PartHeader, kv: memoryview) -> int:
    """Write one rank's part file atomically; kv is header.layout's bytes. Returns its size."""
    return atomic_write(path, part_chunks(header, kv))


def read_part(path: Path) -> tuple[PartHeader, memoryview]:
    """Read and verify a part file. Raises SnapshotError (NOT_FOUND, DAMAGED, MISMATCH)."""
    try:
        data = bytearray(read_confined(path))
    except FileNotFoundError:
        raise SnapshotError(SnapshotStatus.NOT_FOUND, f"part file {path.name} is missing") from None
    except OSError as error:
        raise SnapshotError(SnapshotStatus.DAMAGED, f"part file {path.name} is unreadable: {error}") from None
    return parse_part(data, path.name)


# ---- folders -------------------------------------------------------------------------------


def resolve_inside(root: Path, name: str) -> Path:
    """root/name for a single path component that stays inside root, symlinks resolved.

    The router validates user-given names strictly first; this is the shard's own guard.
    """
    name = unicodedata.normalize("NFC", name)  # one folder for every spelling of a name
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise SnapshotError(SnapshotStatus.INVALID, f"{name!r} is not a single folder name")
    base = root.resolve()
    path = base / name
    if not path.resolve().is_relative_to(base) or path.resolve() == base:
        raise SnapshotError(SnapshotStatus.INVALID, f"{name!r} resolves outside the snapshot directory")
    return path


def write_manifest(folder: Path, manifest: Manifest) -> None:
    atomic_write(folder / MANIFEST, [manifest.to_json()])


def read_manifest(folder: Path) -> Manifest:
    """The manifest of a snapshot folder; SnapshotError NOT_FOUND, DAMAGED or MISMATCH."""
    if not folder.is_dir():
        raise SnapshotError(SnapshotStatus.NOT_FOUND, f"snapshot {folder.name!r} does not exist")
    try:
        data = read_confined(folder / MANIFEST)
    except OSError as error:
        raise SnapshotError(SnapshotStatus.DAMAGED, f"snapshot {folder.name!r} is damaged: manifest: {error}") from None
    return Manifest.from_json(data, folder.name)


def new_staging_dir(root: Path) -> Path:
    path = root / f"{STAGING_PREFIX}{uuid.uuid4().hex}"
    path.mkdir()
    return path


def _trash(path: Path) -> None:
    """Take path out of sight in one rename, then delete it."""
    trash = path.with_name(f"{TRASH_PREFIX}{uuid.uuid4().hex}")
    os.rename(path, trash)
    fsync_dir(path.parent)
    shutil.rmtree(trash, ignore_errors=True)


def commit_dir(staging: Path, final: Path) -> None:
    """Make a complete staging folder the snapshot `final` (replacing an older one)."""
    fsync_dir(staging)
    if final.is_symlink():
        raise SnapshotError(SnapshotStatus.INVALID, f"{final.name!r} is a symbolic link; refusing to replace it")
    if final.exists():
        _trash(final)
    os.rename(staging, final)
    fsync_dir(final.parent)


def remove_dir(path: Path) -> None:
    if not path.is_dir() or path.is_symlink():
        raise SnapshotError(SnapshotStatus.NOT_FOUND, f"snapshot {path.name!r} does not exist")
    _trash(path)


def clean_leftovers(root: Path) -> None:
    """Delete staging and trash folders a crash left behind."""
    for path in root.iterdir():
        if path.name.startswith((STAGING_PREFIX, TRASH_PREFIX)) and path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)


# ---- one shard's store -----------------------------------------------------------------------


@dataclass(slots=True)
class LoadedPart:
    header: PartHeader
    kv: memoryview
    num_bytes: int


class PartStore:
    """One shard's snapshot directory: its rank's parts, the loads it verified but has not
    filled yet, and (rank 0) the manifests and folders."""

    def __init__(self, root: Path | None, rank: int, world_size: int) -> None:
        self.root = root
        self.rank = rank
        self.world_size = world_size
        self._loaded: OrderedDict[str, LoadedPart] = OrderedDict()
        self._lock = threading.Lock()

    def _root(self) -> Path:
        if self.root is None:
            raise SnapshotError(SnapshotStatus.DISABLED, "this shard has no snapshot directory (--snapshot-dir)")
        return self.root

    def folder(self, dir_name: str) -> Path:
        return resolve_inside(self._root(), dir_name)

    def save(self, dir_name: str, fingerprint: dict[str, Any], token_ids: list[int],
             layout: KVLayout, kv: memoryview) -> int:
        """Write this rank's part into the staging folder dir_name (made when missing);
        returns its size in bytes."""
        if not dir_name.startswith(STAGING_PREFIX):
            raise SnapshotError(SnapshotStatus.INVALID, f"{dir_name!r} is not a staging folder")
        folder = self.folder(dir_name)
        folder.mkdir(exist_ok=True)
        header = PartHeader(fingerprint, list(token_ids), layout, self.rank, self.world_size)
        return write_part(folder / part_name(self.rank), header, kv)

    def commit(self, staging_name: str, name: str, fingerprint: dict[str, Any], token_ids: list[int]) -> Manifest:
        """Rank 0: check every rank's part is there, write the manifest, rename into place."""
        staging, final = self.folder(staging_name), self.folder(name)
        parts = {}
        for rank in range(self.world_size):
            part = staging / part_name(rank)
            if not part.is_file():
                raise SnapshotError(SnapshotStatus.FAILED, f"rank {rank}'s part is missing from the staging folder")
            parts[part.name] = part.stat().st_size
        manifest = Manifest(num_shards=self.world_size, num_tokens=len(token_ids), fingerprint=fingerprint,
                            parts=parts, token_ids=list(token_ids))
        write_manifest(staging, manifest)
        commit_dir(staging, final)
        return manifest

    def list_snapshots(self, name: str | None = None) -> list[SnapshotEntry]:
        """One snapshot (NOT_FOUND when missing) or every one, with its manifest or error."""
        if name is not None:
            return [SnapshotEntry(name, read_manifest(self.folder(name)))]
        listed = []
        for folder in sorted(self._root().iterdir()):
            if folder.name.startswith(".") or folder.is_symlink() or not folder.is_dir():
                continue
            try:
                listed.append(SnapshotEntry(folder.name, self._check_own_part(folder, read_manifest(folder))))
            except SnapshotError as error:
                listed.append(SnapshotEntry(folder.name, None, error))
        return listed

    def _check_own_part(self, folder: Path, manifest: Manifest) -> Manifest:
        """The manifest, when this rank's part is there at the size it records; else DAMAGED
        (a restore would fail: the listing says so first)."""
        name = part_name(self.rank)
        expected = manifest.parts.get(name)
        try:
            size = (folder / name).stat().st_size
        except FileNotFoundError:
            raise SnapshotError(SnapshotStatus.DAMAGED, f"part file {name} is missing") from None
        if expected is not None and size != expected:
            raise SnapshotError(SnapshotStatus.DAMAGED, f"part file {name} holds {size} bytes, "
                                f"its manifest says {expected}")
        return manifest

    def delete(self, name: str) -> list[int]:
        """Remove a snapshot folder; returns its tokens (none for another format version's).
        A damaged manifest is refused (DAMAGED) and nothing is removed: what it says cannot be
        trusted, and an operator removes such a folder by hand."""
        folder = self.folder(name)
        if folder.is_symlink():
            raise SnapshotError(SnapshotStatus.INVALID, f"{name!r} is a symbolic link; refusing to delete it")
        try:
            token_ids = read_manifest(folder).token_ids
        except SnapshotError as error:
            if error.status is not SnapshotStatus.MISMATCH:
                raise
            token_ids = []  # another format version: deleted, its cached blocks left alone
        remove_dir(folder)
        return token_ids

    def load(self, dir_name: str, load_id: str, fingerprint: dict[str, Any]) -> LoadedPart:
        """Read, verify and keep this rank's part under load_id."""
        path = self.folder(dir_name) / part_name(self.rank)
        try:
            header, kv = read_part(path)
        except SnapshotError as error:
            if error.status is SnapshotStatus.NOT_FOUND and path.parent.is_dir():  # there, but without its part
                raise SnapshotError(SnapshotStatus.DAMAGED, f"part file {path.name} is missing") from None
            raise
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
