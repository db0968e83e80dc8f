"""The real loom-router process serves the TGI and OpenAI APIs against a fake gRPC shard with
`torch` (and the shard's and launcher's packages) made unimportable."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import httpx
from grpc_fakes import FakeRunner

from loom_proto.config import RouterConfig
from loom_proto.step import SeqOutput, StepPlan
from loom_shard.server import start_server
from tests.net import free_port

# Any import of these raises ImportError in the router process, deferred imports included.
BLOCKED = ("torch", "loom_shard", "loom_launcher")
ROUTER = f"""
import sys
from importlib.abc import MetaPathFinder

class Block(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ImportError(f"{{name}} is blocked: the router must not import it")
        return None

sys.meta_path.insert(0, Block())
for name in list(sys.modules):
    assert name.split(".")[0] not in {BLOCKED!r}, name
from loom_router.main import main
sys.exit(main(sys.argv[1:]))
"""


class DecodingRunner(FakeRunner):
    """Samples a fixed word-piece token for every request in every step."""

    def _outputs(self, plan: StepPlan) -> list[SeqOutput]:
        ids = [r.request_id for r in plan.new_requests] + [r.request_id for r in plan.running_requests]
        return [SeqOutput(request_id=i, token_id=1000, logprob=-0.5) for i in ids]



async def wait_healthy(client: httpx.AsyncClient, router: subprocess.Popen[bytes]) -> None:
    for _ in range(600):
        assert router.poll() is None, "the router exited"
        try:
            if (await client.get("/health")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError("the router never became healthy")


async def test_router_serves_with_torch_unimportable(tmp_path: Path) -> None:
    socket_path = str(tmp_path / "shard-0.sock")
    server, servicer = await start_server(DecodingRunner(), socket_path)
    config = RouterConfig(shard_uds_paths=(socket_path,), hostname="127.0.0.1", port=free_port(),
                          max_total_tokens=64, log_level="warning")
    router = subprocess.Popen([sys.executable, "-c", ROUTER, "--config-json", config.model_dump_json()],
                              stderr=subprocess.PIPE)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{config.port}", timeout=30) as client:
            await wait_healthy(client, router)
            response = await client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 3, "details": True}})
            assert response.status_code == 200, response.text
            assert response.json()["details"]["generated_tokens"] == 3
            chat = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
            assert chat.status_code == 200, chat.text
            assert chat.json()["usage"]["completion_tokens"] == 2
    finally:
        router.terminate()
        _, stderr = router.communicate(timeout=30)
        await server.stop(None)
        servicer.close()
    assert b"is blocked" not in stderr, stderr.decode()
