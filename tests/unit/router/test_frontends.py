"""The engine core's frontend pool: a frontend that exits is reported gone (its requests are
cancelled, their KV freed) and started again; one that keeps dying fails the router instead of
serving in a crash loop."""

from __future__ import annotations

import asyncio

import pytest

from loom_proto.config import RouterConfig
from loom_router.core import frontends
from loom_router.core.frontends import FrontendPool, listening_socket


async def test_a_dying_frontend_is_restarted_then_a_crash_loop_fails_the_router(
        monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(frontends, "FRONTEND_MODULE", "loom_router.no_such_module")  # exits at once, code 1
    monkeypatch.setattr(frontends, "WATCH_INTERVAL_S", 0.02)
    config = RouterConfig(model_id="", shard_uds_paths=("fake.sock",))
    listen = listening_socket("127.0.0.1", 0)
    gone: list[int] = []
    fatal: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    pool = FrontendPool(config, 1, str(tmp_path), listen, None, gone.append, fatal.set_result)
    pids: set[int] = set()
    try:
        pool.start()
        while not fatal.done():
            pids.update(pool.pids)
            await asyncio.sleep(0.005)
        reason = await asyncio.wait_for(fatal, 30)
    finally:
        await pool.stop(timeout_s=1.0)
        listen.close()
    assert gone == [0] * (frontends.MAX_RESTARTS + 1)  # every death cancels that frontend's requests
    assert len(pids) == frontends.MAX_RESTARTS + 1  # started, then restarted after each death but the last
    assert f"frontend 0 died {frontends.MAX_RESTARTS + 1} times" in reason and "exit code 1" in reason
