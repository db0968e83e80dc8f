"""What a cache-aware gateway (sglang-router, vllm-router) reads of a worker: /get_load,
/server_info, /model_info, in SGLang's names, through a frontend and an engine core."""

from __future__ import annotations

import asyncio

from test_api import MAX_TOTAL_TOKENS, Harness, harness  # noqa: F401  (the fixture)


async def test_get_load_counts_running_waiting_and_kv_tokens(harness: Harness) -> None:  # noqa: F811
    idle = (await harness.client.get("/get_load")).json()
    assert idle == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_running_reqs": 0,
                     "num_tokens": 0, "kv_cache_usage": 0.0}]
    harness.backend.step_delay_s = 0.02
    body = {"inputs": "a longer prompt", "parameters": {"max_new_tokens": 20}}
    running = [asyncio.create_task(harness.client.post("/generate", json=body)) for _ in range(3)]
    while harness.engine.stats().num_running < 3:
        await asyncio.sleep(0.005)
    [busy] = (await harness.client.get("/get_load")).json()
    assert busy["num_reqs"] == 3 and busy["num_running_reqs"] == 3 and busy["num_waiting_reqs"] == 0
    block_size = harness.backend.block_size
    assert busy["num_tokens"] >= 3 * block_size and busy["num_tokens"] % block_size == 0
    total = harness.backend.num_blocks * block_size
    assert busy["kv_cache_usage"] == busy["num_tokens"] / total
    assert [r.status_code for r in await asyncio.gather(*running)] == [200] * 3


async def test_server_and_model_info_in_sglang_names(harness: Harness) -> None:  # noqa: F811
    for path in ("/server_info", "/get_server_info"):
        info = (await harness.client.get(path)).json()
        assert info["served_model_name"] and info["dp_size"] == 1
        assert info["context_length"] == MAX_TOTAL_TOKENS and info["max_running_requests"] == 4
        assert info["max_total_tokens"] == harness.backend.num_blocks * harness.backend.block_size
    for path in ("/model_info", "/get_model_info"):
        model = (await harness.client.get(path)).json()
        assert model["is_generation"] is True and model["architectures"] == [model["model_type"]]
