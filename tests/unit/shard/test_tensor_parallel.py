"""Tensor parallelism: two gloo ranks on the CPU give the logits of one unsharded model, for every
family (heads split, sinks with their heads, experts split over the ranks)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from loom_shard.loading.loader import load_model_config, load_model_weights
from loom_shard.loading.tensor_parallel import apply_tensor_parallel, build_rank_model, rank_part
from tests.net import free_port
from tests.unit.shard.conftest import SeqChunk, make_cache, make_pair, random_tokens, run_chunks

WORLD_SIZE = 2


# One model of each family; prompts longer than the windows (8).
KINDS = ["llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "mixtral", "qwen3_moe", "gpt_oss"]


def _chunks() -> list[SeqChunk]:
    a, b = random_tokens(19, 21), random_tokens(13, 22)
    return [SeqChunk(a, 0, 19, [3, 0, 2, 9, 8]), SeqChunk(b, 0, 13, [5, 7, 1, 4])]


def _logits(model) -> torch.Tensor:  # noqa: ANN001
    return torch.cat(run_chunks(model, make_cache(model, block_size=4, num_blocks=10), _chunks()))


def _leave() -> None:
    """A rank whose results are stored exits at once, without the interpreter's teardown: torn
    down with it, gloo's threads once aborted a rank after its work ("terminate called without an
    active exception", SIGABRT), once in some twenty-five runs here."""
    os._exit(0)


def _rank_main(rank: int, port: int, kinds: list[str], results: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    try:
        for kind in kinds:
            model = apply_tensor_parallel(make_pair(kind).loom, rank, WORLD_SIZE)
            assert model.num_kv_heads == model.config.num_kv_heads // WORLD_SIZE
            results[(kind, rank)] = _logits(model)
    finally:
        dist.destroy_process_group()
    _leave()


@pytest.mark.slow
def test_two_ranks_match_one() -> None:
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank_main, args=(free_port(), KINDS, results), nprocs=WORLD_SIZE, join=True)
        for kind in KINDS:
            expected = _logits(make_pair(kind).loom)
            for rank in range(WORLD_SIZE):
                torch.testing.assert_close(results[(kind, rank)], expected, rtol=1e-4, atol=1e-4, msg=kind)


def _rank_weights(pair, rank: int) -> dict[str, torch.Tensor]:
    moe = pair.config.moe
    weights = {}
    for name, tensor in pair.hf.state_dict().items():
        part = rank_part(name, tuple(tensor.shape), rank, WORLD_SIZE, moe.num_experts if moe else 0)
        weights[name] = part.take(tensor) if part else tensor
    return weights


@pytest.mark.parametrize("kind", ["qwen2", "phi3", "qwen3_moe", "gpt_oss"])
def test_rank_model_is_built_on_meta_and_holds_only_its_slices(kind: str) -> None:
    """qwen2: tied embeddings, q/k/v biases; phi3: q/k/v and gate/up read whole, cut by the
    layers; qwen3_moe: experts read one by one, another rank's not at all; gpt_oss: stacked
    experts, sinks, replicated biases of the router and o_proj."""
    pair = make_pair(kind)
    rank_weights = _rank_weights(pair, 1)
    model = build_rank_model(pair.config, rank_weights, rank=1, world_size=WORLD_SIZE)
    tensors = list(model.parameters()) + list(model.buffers())
    assert not any(t.is_meta for t in tensors)
    if pair.config.tie_word_embeddings:
        assert model.lm_head.weight is model.embed_tokens.weight
    assert model.embed_tokens.num_embeddings == pair.config.vocab_size // WORLD_SIZE  # vocabulary-parallel
    if pair.config.moe is not None:  # another rank's experts were never read
        assert sum(t.numel() for n, t in rank_weights.items() if ".experts." in n) * WORLD_SIZE == sum(
            t.numel() for n, t in pair.hf.state_dict().items() if ".experts." in n)
    # Its slices are the ones apply_tensor_parallel cuts from the whole model.
    sliced = apply_tensor_parallel(make_pair(kind).loom, 1, WORLD_SIZE)
    for (name, mine), (_, expected) in zip(model.state_dict().items(), sliced.state_dict().items(), strict=True):
        assert torch.equal(mine, expected), name


def _rank_main_loaded(rank: int, port: int, folders: dict[str, str], results: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    try:
        for kind, folder in folders.items():
            moe = load_model_config(folder).moe
            part = functools.partial(rank_part, rank=rank, world_size=WORLD_SIZE, num_experts=moe.num_experts if moe else 0)
            config, weights = load_model_weights(folder, torch.float32, progress=None, part=part)
            results[(kind, rank)] = _logits(build_rank_model(config, weights, rank, WORLD_SIZE))
    finally:
        dist.destroy_process_group()
    _leave()


@pytest.mark.slow
def test_ranks_loaded_slice_by_slice_match_one(tmp_path: Path) -> None:
    """Each rank reads its slices from a safetensors folder through the real loader."""
    kinds = ["llama", "phi3", "mixtral", "gpt_oss"]
    folders = {}
    for kind in kinds:
        make_pair(kind).hf.save_pretrained(tmp_path / kind)
        folders[kind] = str(tmp_path / kind)
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank_main_loaded, args=(free_port(), folders, results), nprocs=WORLD_SIZE, join=True)
        for kind in kinds:
            expected = _logits(make_pair(kind).loom)
            for rank in range(WORLD_SIZE):
                torch.testing.assert_close(results[(kind, rank)], expected, rtol=1e-4, atol=1e-4, msg=kind)
