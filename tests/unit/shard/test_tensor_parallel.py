"""Tensor parallelism: two gloo ranks on the CPU give the logits of one unsharded model."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from loom_shard.loader import load_model_weights
from loom_shard.tensor_parallel import apply_tensor_parallel, build_rank_model, rank_part
from tests.net import free_port
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



@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_two_ranks_match_one(kind: str) -> None:
    pair = make_pair(kind)
    expected = torch.cat(run_chunks(pair.loom, make_cache(pair.loom, 4, 8), _chunks()))
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank_main, args=(free_port(), kind, results), nprocs=WORLD_SIZE, join=True)
        for rank in range(WORLD_SIZE):
            torch.testing.assert_close(results[rank], expected, rtol=1e-4, atol=1e-4)


def _rank_weights(pair, rank: int) -> dict[str, torch.Tensor]:
    weights = {}
    for name, tensor in pair.hf.state_dict().items():
        part = rank_part(name, tuple(tensor.shape), rank, WORLD_SIZE)
        weights[name] = part.take(tensor) if part else tensor
    return weights


def test_rank_model_is_built_on_meta_and_holds_only_its_slices() -> None:
    pair = make_pair("qwen2")  # tied embeddings and q/k/v biases
    model = build_rank_model(pair.config, _rank_weights(pair, 1), rank=1, world_size=WORLD_SIZE)
    tensors = list(model.parameters()) + list(model.buffers())
    assert not any(t.is_meta for t in tensors)
    assert model.lm_head.weight is model.embed_tokens.weight
    full = sum(p.numel() for p in pair.loom.parameters())
    replicated = sum(p.numel() for n, p in pair.loom.named_parameters() if "norm" in n)
    assert sum(p.numel() for p in model.parameters()) == replicated + (full - replicated) // WORLD_SIZE
    assert model.embed_tokens.num_embeddings == pair.config.vocab_size // WORLD_SIZE  # vocabulary-parallel
    # Its slices are the ones apply_tensor_parallel cuts from the whole model.
    sliced = apply_tensor_parallel(make_pair("qwen2").loom, 1, WORLD_SIZE)
    for (name, mine), (_, expected) in zip(model.state_dict().items(), sliced.state_dict().items(), strict=True):
        assert torch.equal(mine, expected), name


def _rank_main_loaded(rank: int, port: int, folder: str, results: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    try:
        part = functools.partial(rank_part, rank=rank, world_size=WORLD_SIZE)
        config, weights = load_model_weights(folder, torch.float32, progress=None, part=part)
        model = build_rank_model(config, weights, rank, WORLD_SIZE)
        results[rank] = torch.cat(run_chunks(model, make_cache(model, block_size=4, num_blocks=8), _chunks()))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_loaded_slice_by_slice_match_one(tmp_path: Path) -> None:
    """Each rank reads its slices from a safetensors folder through the real loader."""
    pair = make_pair("llama")
    pair.hf.save_pretrained(tmp_path)
    expected = torch.cat(run_chunks(pair.loom, make_cache(pair.loom, 4, 8), _chunks()))
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank_main_loaded, args=(free_port(), str(tmp_path), results), nprocs=WORLD_SIZE, join=True)
        for rank in range(WORLD_SIZE):
            torch.testing.assert_close(results[rank], expected, rtol=1e-4, atol=1e-4)
