"""Snapshot directory confinement on the shard (loom_shard.runtime.snapshot): symbolic links planted
inside the directory, a folder swapped for a link between the name check and the write, and
names that normalise to one another (NFC/NFD). Case-insensitive filesystems are out of scope."""

from __future__ import annotations

import os
import threading
import unicodedata
from collections.abc import Iterator
from pathlib import Path

import pytest

from loom_proto.snapshot import KVLayout, SnapshotError, SnapshotStatus
from loom_shard.runtime import snapshot as snap
from loom_shard.runtime.snapshot import PartStore

FINGERPRINT = {"architecture": "LlamaForCausalLM", "num_layers": 1, "dtype": "float32", "weights_hash": "w"}
LAYOUT = KVLayout(num_layers=1, num_tokens=3, num_kv_heads=1, head_dim=2, dtype="float32")
TOKENS = [7, 8, 9]


def kv() -> memoryview:
    return memoryview(bytes(range(LAYOUT.num_bytes)))


def save(store: PartStore, name: str) -> None:
    staging = f"{snap.STAGING_PREFIX}{abs(hash(name)) % 10_000}"
    store.save(staging, dict(FINGERPRINT), TOKENS, LAYOUT, kv())
    store.commit(staging, name, dict(FINGERPRINT), TOKENS)


@pytest.fixture
def dirs(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """(the snapshot directory, a folder outside it holding a valid snapshot `secret`)."""
    root, outside = tmp_path / "snaps", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    save(PartStore(outside, 0, 1), "secret")
    yield root, outside


def test_links_planted_for_the_files_inside_a_folder_are_not_followed(dirs: tuple[Path, Path]) -> None:
    root, outside = dirs
    planted = root / "planted"
    planted.mkdir()
    for name in (snap.MANIFEST, "rank-0.kv"):
        (planted / name).symlink_to(outside / "secret" / name)
    store = PartStore(root, 0, 1)
    for read in (lambda: store.list_snapshots("planted"), lambda: store.load("planted", "l1", dict(FINGERPRINT))):
        with pytest.raises(SnapshotError) as info:
            read()
        assert info.value.status is SnapshotStatus.DAMAGED
    assert store.take("l1") is None


def test_a_planted_fifo_neither_blocks_nor_is_read(dirs: tuple[Path, Path]) -> None:
    root, _ = dirs
    (root / "fifo").mkdir()
    os.mkfifo(root / "fifo" / snap.MANIFEST)
    errors: list[SnapshotError] = []
    reader = threading.Thread(target=lambda: errors.append(pytest.raises(SnapshotError, snap.read_manifest,
                                                                         root / "fifo").value), daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert not reader.is_alive(), "reading a planted fifo blocked"
    assert errors and errors[0].status is SnapshotStatus.DAMAGED


def test_a_folder_swapped_for_a_link_after_the_check_receives_nothing_outside(
        dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    root, outside = dirs
    store = PartStore(root, 0, 1)
    staging = f"{snap.STAGING_PREFIX}swap"
    (root / staging).mkdir()
    real_chunks = snap.part_chunks

    def swap_then_write(*args: object) -> Iterator[bytes]:
        # runs once the write began: the checked folder moves away, a link takes its name
        os.rename(root / staging, root / "moved")
        (root / staging).symlink_to(outside)
        yield from real_chunks(*args)

    monkeypatch.setattr(snap, "part_chunks", swap_then_write)
    store.save(staging, dict(FINGERPRINT), TOKENS, LAYOUT, kv())
    assert sorted(p.name for p in outside.iterdir()) == ["secret"]  # nothing landed outside
    assert [p.name for p in (root / "moved").iterdir()] == ["rank-0.kv"]  # the checked folder got it
    with pytest.raises(SnapshotError):  # and the link is not followed at commit either
        store.commit(staging, "next", dict(FINGERPRINT), TOKENS)
    assert sorted(p.name for p in outside.iterdir()) == ["secret"]


def test_names_that_normalise_alike_are_one_snapshot(dirs: tuple[Path, Path]) -> None:
    root, _ = dirs
    nfc, nfd = unicodedata.normalize("NFC", "café-é"), unicodedata.normalize("NFD", "café-é")
    assert nfc != nfd
    store = PartStore(root, 0, 1)
    save(store, nfd)
    save(store, nfc)  # replaces it: the same snapshot
    assert [entry.name for entry in store.list_snapshots()] == [nfc]
    assert store.list_snapshots(nfd)[0].manifest.token_ids == TOKENS
    assert store.delete(nfd) == TOKENS
    assert store.list_snapshots() == []
