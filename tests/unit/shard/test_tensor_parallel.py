"""Tensor parallelism: two gloo ranks on the CPU give the logits of one unsharded model."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from loom_shard.tensor_parallel import apply_tensor_parallel
from tests.unit.shard.conftest import SeqChunk, make_cache, make_pair, random_tokens, run_chunks

WORLD_SIZE = 2


def _chunks() -> list[SeqChunk]:
    a, b = random_tokens(11, 21), random_tokens(6, 22)
    return [SeqChunk(a, 0, 11, [3, 0, 2]), SeqChunk(b, 0, 6, [5, 7])]


def _rank_main(rank: int, port: int, kind: str, results: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    try:
        model = apply_tensor_parallel(make_pair(kind).loom, rank, WORLD_SIZE)
        assert model.num_kv_heads == model.config.num_kv_heads // WORLD_SIZE
        cache = make_cache(model, block_size=4, num_blocks=8)
        results[rank] = torch.cat(run_chunks(model, cache, _chunks()))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_two_ranks_match_one(kind: str) -> None:
    pair = make_pair(kind)
    expected = torch.cat(run_chunks(pair.loom, make_cache(pair.loom, 4, 8), _chunks()))
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank_main, args=(_free_port(), kind, results), nprocs=WORLD_SIZE, join=True)
        for rank in range(WORLD_SIZE):
            torch.testing.assert_close(results[rank], expected, rtol=1e-4, atol=1e-4)
