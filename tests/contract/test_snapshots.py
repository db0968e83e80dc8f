"""Snapshot routes against a real Engine and a fake shard whose "KV" is the token id in each
block slot: the snapshot's part file (real format, real PartStore) holds those values, so a
restore that fills the wrong blocks, or fills them wrongly, fails the fake shard's checks."""

from __future__ import annotations

import asyncio
import json
import shutil
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from api_fakes import WORDS, FakeShardClient
from router_harness import InProcessRouter, start_router

from loom_proto.config import RouterConfig
from loom_proto.snapshot import KVLayout, Manifest, SnapshotEntry, SnapshotReply, SnapshotStatus, model_fingerprint
from loom_router.core.engine import Engine
from loom_router.tokenizer import Tokenizer
from loom_shard.runtime.snapshot import PartStore
from loom_shard.server import _snapshot_call as shard_snapshot_call

BLOCK_SIZE = 4


class SnapshotFakeClient(FakeShardClient):
    """The fake shard plus the snapshot RPCs over a real PartStore."""

    def __init__(self, tokenizer: Tokenizer, root: Path) -> None:
        super().__init__(tokenizer.encode(WORDS), tokenizer.vocab_size, tokenizer.eos_token_ids[0],
                         block_size=BLOCK_SIZE, num_blocks=64, max_position_embeddings=128)
        self.parts = PartStore(root, rank=0, world_size=1)
        self.fill_calls: list[list[int]] = []

    async def _fingerprint(self, tokenizer_hash: str, adapter: str = "") -> dict:
        return model_fingerprint(await self.info(), tokenizer_hash, adapter)

    async def save_snapshot(self, dir_name, block_ids, token_ids, tokenizer_hash, adapter="") -> list[SnapshotReply]:
        bs = self.block_size
        values = [self.shard.device[block_ids[p // bs]][p % bs] for p in range(len(token_ids))]
        assert values == list(token_ids), "the held blocks do not hold the sequence"
        kv = memoryview(struct.pack(f"<{2 * len(values)}f", *values, *values))  # "K" then "V"
        layout = KVLayout(1, len(values), 1, 1, "float32")
        return [await _reply(asyncio.to_thread(self.parts.save, dir_name,
                                               await self._fingerprint(tokenizer_hash, adapter), list(token_ids),
                                               layout, kv))]

    async def load_snapshot(self, dir_name, load_id, tokenizer_hash, adapter="") -> list[SnapshotReply]:
        fingerprint = await self._fingerprint(tokenizer_hash, adapter)
        return [await _reply(asyncio.to_thread(self.parts.load, dir_name, load_id, fingerprint))]

    async def fill_snapshot(self, load_id, block_ids, block_indices) -> list[SnapshotReply]:
        loaded = self.parts.take(load_id)
        if block_ids:
            self.fill_calls.append(list(block_ids))
            values = struct.unpack(f"<{2 * loaded.header.layout.num_tokens}f", loaded.kv)
            for block_id, index in zip(block_ids, block_indices):
                self.shard.device[block_id] = [int(v) for v in values[index * BLOCK_SIZE:(index + 1) * BLOCK_SIZE]]
        return [SnapshotReply(SnapshotStatus.OK)]

    async def commit_snapshot(self, staging_name, name, token_ids, tokenizer_hash, adapter="") -> SnapshotReply:
        fingerprint = await self._fingerprint(tokenizer_hash, adapter)
        manifest = asyncio.to_thread(self.parts.commit, staging_name, name, fingerprint, list(token_ids))
        return await _reply(_bytes_of(manifest))

    async def list_snapshots(self, name: str = "") -> tuple[SnapshotReply, list[SnapshotEntry]]:
        entries: list[SnapshotEntry] = []

        async def run() -> SnapshotReply:
            entries.extend(await asyncio.to_thread(self.parts.list_snapshots, name or None))
            return SnapshotReply(SnapshotStatus.OK)

        return await shard_snapshot_call("ListSnapshots", run()), entries

    async def delete_snapshot(self, name: str) -> SnapshotReply:
        async def run() -> SnapshotReply:
            return SnapshotReply(SnapshotStatus.OK, token_ids=await asyncio.to_thread(self.parts.delete, name))

        return await shard_snapshot_call("DeleteSnapshot", run())


async def _bytes_of(manifest) -> int:
    return (await manifest).num_bytes


async def _reply(call) -> SnapshotReply:  # call: an awaitable of a byte count or a LoadedPart
    """What the shard server answers: a failure becomes a status, as loom_shard.server's."""
    async def run() -> SnapshotReply:
        result = await call
        if isinstance(result, int):
            return SnapshotReply(SnapshotStatus.OK, num_bytes=result)
        return SnapshotReply(SnapshotStatus.OK, num_bytes=result.num_bytes, token_ids=result.header.token_ids)

    return await shard_snapshot_call("snapshot", run())


async def _serve(tokenizer: Tokenizer, backend: FakeShardClient, snapshot_dir: str | None):
    config = RouterConfig(model_id="", shard_uds_paths=("fake.sock",), max_total_tokens=128,
                          snapshot_dir=snapshot_dir)
    router = await start_router(config, backend, tokenizer)
    ROUTERS[router.engine] = router
    return router.engine, router.http


ROUTERS: dict[Engine, InProcessRouter] = {}  # by the engine `_serve` returned: what stop() stops


async def stop(engine: Engine) -> None:
    await ROUTERS.pop(engine).stop()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "snaps"  # the shard server makes it at start
    path.mkdir()
    return path


@pytest.fixture
async def served(tokenizer: Tokenizer, root: Path) -> AsyncIterator[tuple[Engine, httpx.AsyncClient, SnapshotFakeClient]]:
    backend = SnapshotFakeClient(tokenizer, root)
    engine, client = await _serve(tokenizer, backend, str(root))
    async with client:
        yield engine, client, backend
    await stop(engine)


def cached_blocks(engine: Engine) -> int:
    return engine.scheduler.block_manager.num_cached_blocks


async def complete(client: httpx.AsyncClient, prompt_ids: list[int], max_tokens: int = 4) -> dict:
    response = await client.post("/v1/completions", json={"prompt": prompt_ids, "max_tokens": max_tokens,
                                                           "temperature": 0, "seed": 7})
    assert response.status_code == 200, response.text
    return response.json()


PROMPT = list(range(100, 118))  # 18 tokens: 4 full blocks of 4 and a partial one


async def test_off_without_snapshot_dir(tokenizer: Tokenizer) -> None:
    engine, client = await _serve(tokenizer, SnapshotFakeClient(tokenizer, Path("/nonexistent")), None)
    async with client:
        for method, url in [("GET", "/snapshots"), ("POST", "/snapshots/a?action=restore"),
                            ("DELETE", "/snapshots/a")]:
            response = await client.request(method, url)
            assert response.status_code == 501 and "--snapshot-dir" in response.json()["error"]
    await stop(engine)


async def test_save_restart_restore_then_prefix_hits(tokenizer: Tokenizer, root: Path, served) -> None:
    engine, client, _ = served
    response = await client.post("/snapshots/sys prompt?action=save", json={"token_ids": PROMPT})
    assert response.status_code == 200, response.text
    saved = response.json()
    assert (saved["name"], saved["tokens"]) == ("sys prompt", len(PROMPT)) and saved["bytes"] > 0
    assert sorted(p.name for p in root.iterdir()) == ["sys prompt"]
    assert engine.scheduler.block_manager.num_used_blocks == 0  # the held blocks were given back

    # A fresh router and shard (empty cache) restore it; the next request skips those blocks.
    # The router's own snapshot_dir does not exist on its host: the shards own the files.
    fresh = SnapshotFakeClient(tokenizer, root)
    router_side = root.parent / "not-on-the-routers-host"
    engine2, client2 = await _serve(tokenizer, fresh, str(router_side))
    async with client2:
        listed = (await client2.get("/snapshots")).json()["snapshots"]
        assert [(s["name"], s["tokens"], s["fits"]) for s in listed] == [("sys prompt", len(PROMPT), True)]
        response = await client2.post("/snapshots/sys%20prompt?action=restore")
        assert response.status_code == 200, response.text
        assert response.json()["tokens"] == len(PROMPT)
        full_blocks = len(PROMPT) // BLOCK_SIZE
        assert cached_blocks(engine2) == full_blocks and len(fresh.fill_calls[0]) == full_blocks
        prompt = PROMPT + [5, 6, 7]
        body = await complete(client2, prompt)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == full_blocks * BLOCK_SIZE
        assert body["choices"][0]["text"] == tokenizer.decode(fresh.reference(prompt, 7, 4))
        # Restoring again finds every block cached: nothing to fill.
        assert (await client2.post("/snapshots/sys%20prompt?action=restore")).status_code == 200
        assert len(fresh.fill_calls) == 1
        # Deleting it also forgets its cached blocks (no request uses them now).
        before = cached_blocks(engine2)
        deleted = await client2.delete("/snapshots/sys%20prompt")
        assert deleted.json()["cached_blocks_dropped"] == full_blocks
        assert not router_side.exists()
        assert cached_blocks(engine2) == before - full_blocks
    await stop(engine2)


async def test_save_from_text_and_messages(served, tokenizer: Tokenizer) -> None:
    _, client, _ = served
    response = await client.post("/snapshots/text?action=save", json={"inputs": WORDS})
    assert response.json()["tokens"] == len(tokenizer.encode(WORDS))
    system = [{"role": "system", "content": "You answer in one word."}]
    response = await client.post("/snapshots/chat?action=save", json={"messages": system})
    saved = tokenizer.encode(tokenizer.apply_chat_template(system, False), add_special_tokens=False)
    assert response.json()["tokens"] == len(saved)
    # what a later conversation starting with these messages begins with (not the assistant's header)
    later = system + [{"role": "user", "content": "hi"}]
    assert tokenizer.encode(tokenizer.apply_chat_template(later), add_special_tokens=False)[:len(saved)] == saved
    body = {"messages": later, "add_generation_prompt": True}  # a request of these very messages
    response = await client.post("/snapshots/ask?action=save", json=body)
    assert response.json()["tokens"] == len(tokenizer.encode(tokenizer.apply_chat_template(later),
                                                             add_special_tokens=False))
    for body in [{}, {"inputs": "a", "token_ids": [1]}, {"token_ids": [10**9]}]:
        assert (await client.post("/snapshots/x?action=save", json=body)).status_code == 422


async def test_refusals_leave_the_cache_unchanged(served, root: Path) -> None:
    engine, client, backend = served
    assert (await client.post("/snapshots/s?action=save", json={"token_ids": PROMPT})).status_code == 200
    before = cached_blocks(engine)
    part = root / "s" / "rank-0.kv"
    manifest_path = root / "s" / "manifest.json"
    good_part, good_manifest = part.read_bytes(), manifest_path.read_text()

    async def restore_status() -> int:
        response = await client.post("/snapshots/s?action=restore")
        return response.status_code

    flipped = bytearray(good_part)
    flipped[len(flipped) // 2] ^= 0x10
    part.write_bytes(bytes(flipped))
    assert await restore_status() == 422
    part.write_bytes(good_part[:-10])
    assert await restore_status() == 422
    (listed,) = (await client.get("/snapshots")).json()["snapshots"]  # the listing says so before a restore
    assert not listed["fits"] and "holds" in listed["reason"] and listed["adapter"] is None
    part.unlink()  # a part gone: damaged too, not "no such snapshot"
    response = await client.post("/snapshots/s?action=restore")
    assert response.status_code == 422 and "rank-0.kv is missing" in response.json()["error"]
    (listed,) = (await client.get("/snapshots")).json()["snapshots"]
    assert not listed["fits"] and "rank-0.kv is missing" in listed["reason"]
    part.write_bytes(good_part)
    for field, value in [("weights_hash", "other"), ("dtype", "bfloat16"), ("quantization", "Q4_1 x120")]:
        manifest = json.loads(good_manifest)
        manifest["fingerprint"][field] = value
        manifest_path.write_text(json.dumps(manifest))
        response = await client.post("/snapshots/s?action=restore")
        assert response.status_code == 409 and field in response.json()["error"]
    manifest = json.loads(good_manifest)
    manifest["num_shards"] = 2
    manifest_path.write_text(json.dumps(manifest))
    response = await client.post("/snapshots/s?action=restore")
    assert response.status_code == 409 and "shard count" in response.json()["error"]
    manifest_path.write_text(good_manifest)
    assert (await client.post("/snapshots/missing?action=restore")).status_code == 404
    assert cached_blocks(engine) == before and backend.fill_calls == []
    assert engine.scheduler.block_manager.num_used_blocks == 0
    assert backend.parts.take("anything") is None and not backend.parts._loaded  # every load forgotten
    await complete(client, [1, 2, 3])  # still serving


async def test_405_on_a_snapshot_allows_both_its_methods(served) -> None:
    _, client, _ = served
    response = await client.get("/snapshots/x")
    assert response.status_code == 405 and response.headers["allow"] == "DELETE, POST"
    save = (await client.get("/openapi.json")).json()["paths"]["/snapshots/{name}"]["post"]["requestBody"]
    body = save["content"]["application/json"]["schema"]
    shapes = {item.get("$ref", "").rsplit("/", 1)[-1] for item in body["anyOf"]}
    assert {"SaveInputs", "SaveMessages", "SaveTokenIds"} <= shapes  # exactly one of them, each its own shape


async def test_delete_and_list(served, root: Path) -> None:
    _, client, _ = served
    assert (await client.post("/snapshots/d?action=save", json={"token_ids": [1, 2, 3]})).status_code == 200
    (root / "broken").mkdir()
    listed = {s["name"]: s for s in (await client.get("/snapshots")).json()["snapshots"]}
    assert listed["d"]["fits"] and listed["d"]["tokens"] == 3 and listed["d"]["created"] > 0
    assert not listed["broken"]["fits"] and "damaged" in listed["broken"]["reason"]
    assert (await client.delete("/snapshots/d")).status_code == 200
    assert (await client.delete("/snapshots/d")).status_code == 404
    assert sorted(p.name for p in root.iterdir()) == ["broken"]


def damaged_manifests(good: str) -> list[str]:
    """The manifest text of a snapshot, damaged in ways that read as JSON and ways that do not."""
    def edited(**fields: object) -> str:
        return json.dumps({**json.loads(good), **fields})

    tokens = json.loads(good)["token_ids"]
    return [good[: len(good) // 2], "", "[]", edited(token_ids=[-1] * len(tokens)),
            edited(token_ids=[2**40] * len(tokens)), edited(token_ids=["a"] * len(tokens)),
            edited(num_tokens=len(tokens) + 1), edited(num_shards="1"), edited(parts=[1]), edited(fingerprint=None),
            edited(token_ids=tokens[:-1])]


async def test_a_damaged_manifest_is_a_422_and_changes_nothing(served, root: Path) -> None:
    """Deleting a damaged copy must neither fail half-way (a 500 after removing the folder) nor
    drop the prefix-cache blocks a good snapshot of the same tokens restored."""
    engine, client, _ = served
    assert (await client.post("/snapshots/good?action=save", json={"token_ids": PROMPT})).status_code == 200
    assert (await client.post("/snapshots/good?action=restore")).status_code == 200
    cached = cached_blocks(engine)
    assert cached > 0
    shutil.copytree(root / "good", root / "copy")
    good_manifest = (root / "good" / "manifest.json").read_text()
    for damaged in damaged_manifests(good_manifest):
        (root / "copy" / "manifest.json").write_text(damaged)
        for method, url in [("DELETE", "/snapshots/copy"), ("POST", "/snapshots/copy?action=restore")]:
            response = await client.request(method, url)
            assert response.status_code == 422, (damaged, response.text)
            assert response.json()["error_type"] == "damaged" and str(root) not in response.text
        listed = {s["name"]: s for s in (await client.get("/snapshots")).json()["snapshots"]}
        assert not listed["copy"]["fits"] and "damaged" in listed["copy"]["reason"]
        assert (root / "copy" / "manifest.json").read_text() == damaged
        assert cached_blocks(engine) == cached
    # A copy whose manifest is whole (its part file broken) can be deleted: the good one keeps its blocks.
    (root / "copy" / "manifest.json").write_text(good_manifest)
    (root / "copy" / "rank-0.kv").write_bytes(b"broken")
    response = await client.delete("/snapshots/copy")
    assert response.status_code == 200 and response.json()["cached_blocks_dropped"] == 0
    assert cached_blocks(engine) == cached and not (root / "copy").exists()
    response = await client.delete("/snapshots/good")
    assert response.status_code == 200 and response.json()["cached_blocks_dropped"] == cached
    assert cached_blocks(engine) == 0


async def test_error_bodies_hold_no_absolute_path(served, root: Path) -> None:
    _, client, _ = served
    assert (await client.post("/snapshots/s?action=save", json={"token_ids": [1, 2, 3]})).status_code == 200
    shutil.rmtree(root)  # the directory went away under the server
    for method, url in [("GET", "/snapshots"), ("POST", "/snapshots/s?action=restore"), ("DELETE", "/snapshots/s"),
                        ("POST", "/snapshots/t?action=save")]:
        response = await client.request(method, url, json={"token_ids": [1, 2, 3]})
        assert 400 <= response.status_code < 600, response.text
        assert str(root) not in response.text and str(root.parent) not in response.text, response.text


BAD_URL_NAMES = ["a%2Fb", "a/b", "a%5Cb", "a:b", "a%2A", "a%3F", "a%22b", "a%3Cb", "a%3Eb", "a%7Cb", "%2E",
                 "%2E%2E", "%2E%2E%2Fescape", "x%2E%2E", "%20a", "a%20", "a.", "a%01", "a%0Ab", "%EF%BB%BFa",
                 "a%E2%80%8Db", "caf%E9", "e%CC%81", "a" * 256]


@pytest.mark.parametrize("name", BAD_URL_NAMES)
async def test_bad_names_are_400_and_write_nothing(served, root: Path, tmp_path: Path, name: str) -> None:
    _, client, _ = served
    await client.get("/snapshots")  # creates the directory
    before = sorted(p.name for p in tmp_path.iterdir())
    response = await client.post(f"/snapshots/{name}?action=save", json={"token_ids": [1, 2, 3]})
    assert response.status_code == 400, response.text
    assert (await client.post(f"/snapshots/{name}?action=restore")).status_code == 400
    assert (await client.delete(f"/snapshots/{name}")).status_code == 400
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert list(root.iterdir()) == []


async def test_symlink_out_of_the_directory_is_refused(served, root: Path, tmp_path: Path) -> None:
    _, client, _ = served
    await client.get("/snapshots")  # creates the directory
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "link").symlink_to(outside)
    for method, url in [("POST", "/snapshots/link?action=save"), ("POST", "/snapshots/link?action=restore"),
                        ("DELETE", "/snapshots/link")]:
        response = await client.request(method, url, json={"token_ids": [1, 2, 3]})
        assert response.status_code == 400, (url, response.text)
    assert list(outside.iterdir()) == []


# ---- the snapshot RPCs over gRPC: the real server and ShardClient around a real tiny runner ----


@pytest.fixture
async def grpc_shard(tmp_path: Path):
    """A real ModelRunner (tiny random Llama, float32, block size 4) served over a unix socket."""
    import torch

    from loom_proto.config import ShardConfig
    from loom_router.core.shard_client import ShardClient
    from loom_shard.runtime.runner import ModelRunner
    from loom_shard.server import start_server
    from tests.unit.shard.conftest import make_pair

    runner = ModelRunner(ShardConfig(model_id="tiny", uds_path="", dtype="float32", block_size=BLOCK_SIZE),
                         model=make_pair("llama").loom)
    with torch.inference_mode():
        runner.allocate_kv_cache(num_blocks=16, num_host_blocks=0)
        runner.kv_cache.device_blocks.normal_()
    (tmp_path / "snaps").mkdir()
    server, servicer = await start_server(runner, str(tmp_path / "shard.sock"), str(tmp_path / "snaps"))
    client = ShardClient([str(tmp_path / "shard.sock")])
    await client.wait_ready(timeout_s=5.0)
    yield runner, client, tmp_path / "snaps"
    await client.close()
    await server.stop(None)
    servicer.close()


async def test_snapshot_rpcs_copy_exact_kv_and_report_statuses(grpc_shard) -> None:
    import torch

    runner, client, root = grpc_shard
    tokens = list(range(10, 20))  # 10 tokens: 2 full blocks of 4
    [saved] = await client.save_snapshot(".staging-1", [5, 1, 7], tokens, "tok")
    assert saved.status is SnapshotStatus.OK
    assert saved.num_bytes == (root / ".staging-1" / "rank-0.kv").stat().st_size
    committed = await client.commit_snapshot(".staging-1", "s", tokens, "tok")
    assert committed.status is SnapshotStatus.OK and committed.num_bytes == saved.num_bytes
    assert not (root / ".staging-1").exists() and (root / "s" / "manifest.json").is_file()
    listed, [entry] = await client.list_snapshots("s")
    assert listed.status is SnapshotStatus.OK and entry.manifest.token_ids == tokens
    assert entry.manifest.fingerprint["tokenizer_hash"] == "tok"
    [loaded] = await client.load_snapshot("s", "L1", "tok")
    assert loaded.status is SnapshotStatus.OK and loaded.token_ids == tokens
    [filled] = await client.fill_snapshot("L1", [12, 3], [1, 0])
    assert filled.status is SnapshotStatus.OK
    cache = runner.kv_cache
    assert torch.equal(cache.read_blocks([3, 12], 8), cache.read_blocks([5, 1], 8))

    statuses = [
        (await client.save_snapshot("not-a-staging-folder", [0], [1], "tok"))[0].status,
        (await client.save_snapshot("../escape", [0], [1], "tok"))[0].status,
        (await client.save_snapshot(".staging-2", [99], [1], "tok"))[0].status,  # a bad block
        (await client.load_snapshot("nothing", "L2", "tok"))[0].status,
        (await client.load_snapshot("s", "L3", "another tokenizer"))[0].status,
        (await client.fill_snapshot("never-loaded", [2], [0]))[0].status,
        (await client.commit_snapshot(".staging-none", "t", [1], "tok")).status,
        (await client.list_snapshots("nothing"))[0].status,
        (await client.delete_snapshot("nothing")).status,
    ]
    assert statuses == [SnapshotStatus.INVALID, SnapshotStatus.INVALID, SnapshotStatus.INVALID,
                        SnapshotStatus.NOT_FOUND, SnapshotStatus.MISMATCH, SnapshotStatus.NOT_FOUND,
                        SnapshotStatus.FAILED, SnapshotStatus.NOT_FOUND, SnapshotStatus.NOT_FOUND]
    part = root / "s" / "rank-0.kv"
    part.write_bytes(part.read_bytes()[:-3])
    assert (await client.load_snapshot("s", "L4", "tok"))[0].status is SnapshotStatus.DAMAGED
    deleted = await client.delete_snapshot("s")
    assert deleted.status is SnapshotStatus.OK and deleted.token_ids == tokens and not (root / "s").exists()
    # A manifest whose token ids the protocol cannot carry: DAMAGED, kept, never a half-done delete.
    (root / "bad").mkdir()
    (root / "bad" / "manifest.json").write_text(committed_manifest(tokens, token_ids=[-1] * len(tokens)))
    refused = await client.delete_snapshot("bad")
    assert refused.status is SnapshotStatus.DAMAGED and (root / "bad" / "manifest.json").exists()
    assert await client.health()


def committed_manifest(tokens: list[int], **fields: object) -> str:
    manifest = Manifest(num_shards=1, num_tokens=len(tokens), fingerprint={}, parts={}, token_ids=tokens)
    return json.dumps({**json.loads(manifest.to_json()), **fields})
