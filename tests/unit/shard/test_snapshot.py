"""KV snapshot files: round trip, every corruption class, atomicity, folders, and the runner's
KV copies (independent of the block size)."""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

import pytest
import torch

from loom_proto import snapshot as fmt
from loom_proto.snapshot import KVLayout, PartHeader, SnapshotError, SnapshotStatus
from loom_shard.runtime import snapshot as snap
from loom_shard.runtime.runner import ModelRunner
from loom_shard.runtime.snapshot import PartStore
from tests.unit.shard.conftest import tiny_runner

FINGERPRINT = {"architecture": "LlamaForCausalLM", "num_layers": 2, "dtype": "float32", "weights_hash": "w1",
               "tokenizer_hash": "t1"}
LAYOUT = KVLayout(num_layers=2, num_tokens=5, num_kv_heads=2, head_dim=4, dtype="float32")


def kv_bytes(layout: KVLayout = LAYOUT) -> bytes:
    return bytes((i * 7 + 3) % 251 for i in range(layout.num_bytes))


def header(**overrides: object) -> PartHeader:
    fields: dict = {"fingerprint": dict(FINGERPRINT), "token_ids": [5, 6, 7, 8, 9], "layout": LAYOUT,
                    "rank": 0, "world_size": 1}
    return PartHeader(**{**fields, **overrides})


@pytest.fixture
def part(tmp_path: Path) -> Path:
    path = tmp_path / "rank-0.kv"
    snap.write_part(path, header(), memoryview(kv_bytes()))
    return path


def status_of(path: Path) -> SnapshotStatus:
    with pytest.raises(SnapshotError) as info:
        snap.read_part(path)
    return info.value.status


def rehash(data: bytearray) -> bytearray:
    """Recompute the trailing checksum: a structurally wrong file that is not 'damaged'."""
    data[-32:] = hashlib.sha256(data[:-32]).digest()
    return data


# ---- round trip and corruption ------------------------------------------------------------


def test_round_trip(part: Path) -> None:
    read_header, kv = snap.read_part(part)
    assert read_header == header()
    assert bytes(kv) == kv_bytes()
    assert part.stat().st_size == len(fmt.MAGIC) + 8 + len(header().to_json()) + LAYOUT.num_bytes + 32


def test_missing_file_is_not_found(tmp_path: Path) -> None:
    assert status_of(tmp_path / "nope.kv") is SnapshotStatus.NOT_FOUND


@pytest.mark.parametrize("keep", [0, 5, 12, 40, -33, -1])
def test_truncated_file_is_damaged(part: Path, keep: int) -> None:
    data = part.read_bytes()
    part.write_bytes(data[:keep] if keep >= 0 else data[:len(data) + keep])
    assert status_of(part) is SnapshotStatus.DAMAGED


@pytest.mark.parametrize("where", ["magic", "version", "header", "kv_first", "kv_last", "checksum"])
def test_one_flipped_byte_anywhere_is_damaged(part: Path, where: str) -> None:
    data = bytearray(part.read_bytes())
    header_len = len(header().to_json())
    kv_start = len(fmt.MAGIC) + 8 + header_len
    offset = {"magic": 2, "version": len(fmt.MAGIC), "header": len(fmt.MAGIC) + 8 + 3,
              "kv_first": kv_start, "kv_last": len(data) - 33, "checksum": len(data) - 1}[where]
    data[offset] ^= 0x01
    part.write_bytes(bytes(data))
    assert status_of(part) is SnapshotStatus.DAMAGED


def test_other_format_version_is_a_mismatch_naming_it(part: Path) -> None:
    data = bytearray(part.read_bytes())
    struct.pack_into("<I", data, len(fmt.MAGIC), fmt.FORMAT_VERSION + 1)
    part.write_bytes(bytes(rehash(data)))
    with pytest.raises(SnapshotError) as info:
        snap.read_part(part)
    assert info.value.status is SnapshotStatus.MISMATCH and "format version" in info.value.message


def test_intact_file_with_wrong_structure_is_damaged(part: Path) -> None:
    data = bytearray(part.read_bytes())
    part.write_bytes(bytes(rehash(data[:-40] + data[-32:])))  # 8 KV bytes missing, checksum valid
    assert status_of(part) is SnapshotStatus.DAMAGED
    data = bytearray(part.read_bytes())
    start = len(fmt.MAGIC) + 8
    data[start] = ord("[")  # the header is no longer the JSON object it should be
    part.write_bytes(bytes(rehash(data)))
    assert status_of(part) is SnapshotStatus.DAMAGED


@pytest.mark.parametrize("field,value", [("weights_hash", "w2"), ("dtype", "bfloat16"), ("tokenizer_hash", "t2")])
def test_fingerprint_mismatch_names_the_field(field: str, value: str) -> None:
    with pytest.raises(SnapshotError) as info:
        fmt.check_part(header(), {**FINGERPRINT, field: value}, rank=0, world_size=1)
    assert info.value.status is SnapshotStatus.MISMATCH and info.value.message.startswith(field)


def test_shard_count_mismatch() -> None:
    with pytest.raises(SnapshotError) as info:
        fmt.check_part(header(), FINGERPRINT, rank=0, world_size=2)
    assert info.value.status is SnapshotStatus.MISMATCH and "shard count" in info.value.message
    fmt.check_part(header(), FINGERPRINT, rank=0, world_size=1)  # agrees: no error


# ---- atomicity ----------------------------------------------------------------------------


def test_failed_write_leaves_nothing_behind(tmp_path: Path) -> None:
    def chunks():
        yield b"partial data"
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        snap.atomic_write(tmp_path / "x.kv", chunks())
    assert list(tmp_path.iterdir()) == []


def test_failed_overwrite_keeps_the_old_file(part: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = part.read_bytes()

    def no_fsync(fd: int) -> None:
        raise OSError("I/O error")

    monkeypatch.setattr(os, "fsync", no_fsync)
    with pytest.raises(OSError):
        snap.write_part(part, header(token_ids=[1, 1, 1, 1, 1]), memoryview(kv_bytes()))
    assert part.read_bytes() == before
    assert [p.name for p in part.parent.iterdir()] == [part.name]


def test_write_refuses_kv_of_the_wrong_size(tmp_path: Path) -> None:
    with pytest.raises(SnapshotError):
        snap.write_part(tmp_path / "x.kv", header(), memoryview(kv_bytes()[:-1]))
    assert list(tmp_path.iterdir()) == []


# ---- folders ------------------------------------------------------------------------------


def test_resolve_inside_refuses_escapes(tmp_path: Path) -> None:
    root = tmp_path / "snaps"
    root.mkdir()
    (root / "out").symlink_to(tmp_path)
    for name in ["", ".", "..", "a/b", "../x", "out", "x\0"]:
        with pytest.raises(SnapshotError) as info:
            snap.resolve_inside(root, name)
        assert info.value.status is SnapshotStatus.INVALID, name
    assert snap.resolve_inside(root, "ok") == root.resolve() / "ok"


def test_folder_commit_replace_remove_and_cleanup(tmp_path: Path) -> None:
    manifest = fmt.Manifest(num_shards=1, num_tokens=5, fingerprint=dict(FINGERPRINT), parts={"rank-0.kv": 10},
                            token_ids=[1, 2, 3, 4, 5])
    for generation in (1, 2):  # the second commit replaces the first
        staging = snap.new_staging_dir(tmp_path)
        (staging / "rank-0.kv").write_bytes(b"x" * generation)
        snap.write_manifest(staging, manifest)
        snap.commit_dir(staging, tmp_path / "s")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]
    assert (tmp_path / "s" / "rank-0.kv").read_bytes() == b"xx"
    assert snap.read_manifest(tmp_path / "s") == manifest
    snap.remove_dir(tmp_path / "s")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(SnapshotError) as info:
        snap.read_manifest(tmp_path / "s")
    assert info.value.status is SnapshotStatus.NOT_FOUND
    snap.new_staging_dir(tmp_path)
    snap.clean_leftovers(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_manifest_damage_and_version(tmp_path: Path) -> None:
    folder = tmp_path / "s"
    folder.mkdir()
    for text, status in [("{not json", SnapshotStatus.DAMAGED), ('{"kind": "other"}', SnapshotStatus.DAMAGED),
                         ('{"kind": "loom-kv-snapshot", "num_shards": 1}', SnapshotStatus.DAMAGED)]:
        (folder / snap.MANIFEST).write_text(text)
        with pytest.raises(SnapshotError) as info:
            snap.read_manifest(folder)
        assert info.value.status is status, text
    manifest = fmt.Manifest(1, 5, {}, {}, format_version=fmt.FORMAT_VERSION + 1)
    snap.write_manifest(folder, manifest)
    with pytest.raises(SnapshotError) as info:
        snap.read_manifest(folder)
    assert info.value.status is SnapshotStatus.MISMATCH


# ---- the shard's side ---------------------------------------------------------------------


def make_runner(llama_pair, block_size: int) -> ModelRunner:
    return tiny_runner(llama_pair, block_size, num_blocks=16)


def test_runner_kv_round_trip_across_block_sizes(llama_pair, tmp_path: Path) -> None:
    """Save from a block-size-4 cache, restore the full blocks into a block-size-8 cache."""
    source = make_runner(llama_pair, block_size=4)
    torch.manual_seed(0)
    with torch.inference_mode():
        source.kv_cache.device_blocks.normal_()
    num_tokens = 19
    layout, kv = source.read_kv([3, 9, 1, 0, 5], num_tokens)
    store = PartStore(tmp_path, rank=0, world_size=1)
    store.save(".staging-1", dict(FINGERPRINT), list(range(num_tokens)), layout, kv)
    store.commit(".staging-1", "s", dict(FINGERPRINT), list(range(num_tokens)))
    loaded = store.load("s", "load-1", dict(FINGERPRINT))
    assert loaded.header.token_ids == list(range(num_tokens)) and store.take("load-1") is loaded
    assert store.take("load-1") is None

    target = make_runner(llama_pair, block_size=8)
    target.write_kv([7, 2], [1, 0], loaded.header.layout, loaded.kv)  # tokens 8..15 -> block 7, 0..7 -> block 2
    expected = source.kv_cache.read_blocks([3, 9, 1, 0, 5], num_tokens)
    assert torch.equal(target.kv_cache.read_blocks([2, 7], 16), expected[:, :, :16])
    assert target.kv_cache.device_blocks[:, :, [0, 1, 3]].abs().sum() == 0  # nothing else written


def test_runner_write_kv_refuses_partial_blocks_and_bad_ids(llama_pair) -> None:
    runner = make_runner(llama_pair, block_size=4)
    layout, kv = runner.read_kv([0, 1], 6)
    with pytest.raises(ValueError):
        runner.write_kv([2], [1], layout, kv)  # block 1 holds only 2 of 4 tokens
    with pytest.raises(ValueError):
        runner.write_kv([99], [0], layout, kv)
    with pytest.raises(ValueError):
        runner.read_kv([0], 6)


def test_store_without_directory_is_disabled() -> None:
    with pytest.raises(SnapshotError) as info:
        PartStore(None, 0, 1).load("s", "x", {})
    assert info.value.status is SnapshotStatus.DISABLED
    with pytest.raises(SnapshotError) as info:
        PartStore(None, 0, 1).list_snapshots()
    assert info.value.status is SnapshotStatus.DISABLED


def save_parts(store_root: Path, world_size: int, staging: str, token_ids: list[int]) -> None:
    for rank in range(world_size):
        PartStore(store_root, rank, world_size).save(staging, dict(FINGERPRINT), token_ids, LAYOUT,
                                                     memoryview(kv_bytes()))


def test_rank0_commits_lists_and_deletes_every_ranks_folder(tmp_path: Path) -> None:
    """The shards own every file: rank 0 writes the manifest once all parts are there."""
    token_ids = list(range(LAYOUT.num_tokens))
    store = PartStore(tmp_path, rank=0, world_size=2)
    save_parts(tmp_path, 1, ".staging-a", token_ids)  # rank 1's part is missing
    with pytest.raises(SnapshotError, match="rank 1's part is missing"):
        store.commit(".staging-a", "s", dict(FINGERPRINT), token_ids)
    assert not (tmp_path / "s").exists()
    save_parts(tmp_path, 2, ".staging-b", token_ids)
    manifest = store.commit(".staging-b", "s", dict(FINGERPRINT), token_ids)
    assert manifest.num_shards == 2 and set(manifest.parts) == {"rank-0.kv", "rank-1.kv"}
    assert not (tmp_path / ".staging-b").exists()
    (tmp_path / "broken").mkdir()
    listed = store.list_snapshots()
    assert [e.name for e in listed] == ["broken", "s"]
    assert listed[0].manifest is None and listed[0].error.status is SnapshotStatus.DAMAGED
    assert listed[1].manifest == manifest
    assert store.list_snapshots("s")[0].manifest == manifest
    assert store.delete("s") == token_ids
    with pytest.raises(SnapshotError) as info:  # a damaged snapshot is left as it is
        store.delete("broken")
    assert info.value.status is SnapshotStatus.DAMAGED and (tmp_path / "broken").is_dir()
    with pytest.raises(SnapshotError) as info:
        store.delete("s")
    assert info.value.status is SnapshotStatus.NOT_FOUND


def test_save_writes_only_into_staging_folders(tmp_path: Path) -> None:
    with pytest.raises(SnapshotError) as info:
        save_parts(tmp_path, 1, "not-staging", [0, 1, 2, 3, 4])
    assert info.value.status is SnapshotStatus.INVALID


def test_symlinks_are_never_followed_out_nor_replaced(tmp_path: Path) -> None:
    root = tmp_path / "snaps"
    root.mkdir()
    (root / "escape").symlink_to(tmp_path)  # a valid name whose target lies outside
    (root / "real").mkdir()
    (root / "alias").symlink_to(root / "real")  # inside: fine to read, never replaced
    store = PartStore(root, rank=0, world_size=1)
    with pytest.raises(SnapshotError) as info:
        store.list_snapshots("escape")
    assert info.value.status is SnapshotStatus.INVALID
    assert snap.resolve_inside(root, "plain") == root.resolve() / "plain"
    assert snap.resolve_inside(root, "alias") == root.resolve() / "alias"
    token_ids = list(range(LAYOUT.num_tokens))
    save_parts(root, 1, ".staging-c", token_ids)
    with pytest.raises(SnapshotError, match="symbolic link"):
        store.commit(".staging-c", "alias", dict(FINGERPRINT), token_ids)
    with pytest.raises(SnapshotError, match="symbolic link"):
        store.delete("alias")
    assert (root / "real").is_dir() and (root / "alias").is_symlink()
