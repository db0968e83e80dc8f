"""Shards over TCP: the real server and ShardClient on loopback, around a fake runner. A shard's
port serves only the router holding the shared secret, and says so once per stranger."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_fakes import FakeRunner
from test_grpc import decode_plan

from loom_proto import shard_pb2_grpc
from loom_proto.codec import pb
from loom_proto.config import RouterConfig, ShardConfig
from loom_router.core.shard_client import ShardClient, ShardError
from loom_shard.server import start_server
from tests.net import free_port

SECRET = "s3cret-for-tests"


@pytest.fixture
async def tcp_shards() -> AsyncIterator[list[str]]:
    """Two ranks on loopback TCP, each demanding SECRET; yields their addresses."""
    started, addresses = [], []
    for rank in range(2):
        address = f"127.0.0.1:{free_port()}"
        started.append(await start_server(FakeRunner(rank=rank, world_size=2), tcp_address=address, secret=SECRET))
        addresses.append(address)
    yield addresses
    for server, servicer in started:
        await server.stop(None)
        servicer.close()


async def test_the_router_with_the_secret_drives_tcp_shards(tcp_shards: list[str]) -> None:
    client = ShardClient(tcp_shards, secret=SECRET)
    try:
        await client.wait_ready(timeout_s=5.0)
        assert (await client.info()).world_size == 2
        result = await client.step(decode_plan())
        assert [out.request_id for out in result.outputs] == [1, 9]
        assert await client.health()
    finally:
        await client.close()


async def test_a_stranger_is_refused_and_logged_once(tcp_shards: list[str],
                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="loom_shard.auth")
    wrong = ShardClient(tcp_shards[:1], secret="not-the-secret")
    try:
        with pytest.raises(ShardError) as refused:
            await wrong.step(decode_plan())
        assert refused.value.code == "UNAUTHENTICATED" and "shard secret" in refused.value.message
        assert not await wrong.health()
    finally:
        await wrong.close()
    async with grpc.aio.insecure_channel(tcp_shards[0]) as channel:  # no secret at all
        with pytest.raises(grpc.aio.AioRpcError) as bare:
            await shard_pb2_grpc.ShardStub(channel).Info(pb.InfoRequest())
        assert bare.value.code() == grpc.StatusCode.UNAUTHENTICATED
    lines = [r.getMessage() for r in caplog.records if r.name == "loom_shard.auth"]
    assert len(lines) == 1, lines  # one per stranger's host: not per call, nor per connection
    assert all("rank 0 refused a connection from ipv4:127.0.0.1:" in line for line in lines)


async def test_tcp_without_a_secret_is_refused() -> None:
    with pytest.raises(ValueError, match="without the shard secret"):
        await start_server(FakeRunner(), tcp_address=f"127.0.0.1:{free_port()}")
    with pytest.raises(ValueError, match="shard secret"):
        ShardConfig(tcp_address="127.0.0.1:7000")
    with pytest.raises(ValueError, match="shard secret"):
        RouterConfig(shard_addresses=("10.0.0.2:7000",))


def test_router_targets_in_rank_order() -> None:
    tcp = RouterConfig(shard_addresses=("a:7000", "[::1]:7001"), shard_secret=SECRET)
    assert tcp.shard_targets() == ("a:7000", "[::1]:7001")
    assert RouterConfig(shard_uds_paths=("/tmp/s-0",)).shard_targets() == ("unix:///tmp/s-0",)
    with pytest.raises(ValueError, match="one of the two"):
        RouterConfig(shard_uds_paths=("/tmp/s-0",), shard_addresses=("a:7000",), shard_secret=SECRET)
    with pytest.raises(ValueError, match="not host:port"):
        RouterConfig(shard_addresses=("no-port",), shard_secret=SECRET)


def test_frontends_get_no_shard_address_nor_secret() -> None:
    from loom_proto.config import FrontendConfig, public_json, secrets_json

    router = RouterConfig(shard_addresses=("10.0.0.2:7000",), shard_secret=SECRET)
    frontend = FrontendConfig(**router.model_dump(exclude=FrontendConfig.SHARD_FIELDS), ipc_folder="/tmp/x",
                              listen_fd=3)
    assert frontend.shard_secret is None and frontend.shard_addresses == () and frontend.shard_uds_paths == ()
    assert secrets_json(frontend) is None and SECRET not in public_json(frontend)
