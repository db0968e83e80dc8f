"""Tiny random Hugging Face models and helpers to run Loom's model on the same weights."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
import transformers

from loom_proto.config import ShardConfig
from loom_shard import kernels
from loom_shard.attention.metadata import SeqSpan, build_metadata
from loom_shard.loading.loader import config_from_hf
from loom_shard.model_config import ModelConfig
from loom_shard.models import build_model
from loom_shard.models.decoder import DecoderModel
from loom_shard.runtime.kv_cache import KVCacheSpec, PagedKVCache
from loom_shard.runtime.runner import ModelRunner
from tests.unit.shard import families


@pytest.fixture(params=[isa.name for isa in kernels.ISAS])
def kernel_isa(request: pytest.FixtureRequest) -> Iterator[kernels.Isa]:
    """The test runs once per build of Loom's CPU kernels, each the shard's in turn. A build the CPU
    cannot execute is skipped (the machine lacks the instructions); one that fails to build fails."""
    isa = kernels.by_name(request.param)
    if not kernels.runnable(isa):
        pytest.skip(f"this CPU cannot execute the {isa.name} build")
    previous = kernels.selection()
    kernels.select(isa.name)
    yield isa
    kernels.select(previous.isa.name if previous.isa else "off")


# The tiny Llama-shaped config (without the families' larger initializer range).
TINY = {key: value for key, value in families.BASE.items() if key != "initializer_range"}
LLAMA3_SCALING = families.LLAMA3_SCALING


@dataclass(slots=True)
class TinyPair:
    """The same random weights as a transformers model and as a Loom model."""

    hf: transformers.PreTrainedModel
    loom: DecoderModel
    config: ModelConfig


def model_config_from_hf(hf_config: transformers.PretrainedConfig) -> ModelConfig:
    """The loader's own conversion, so the parity tests also cover config.json reading."""
    return config_from_hf(hf_config.to_dict())


def make_pair(kind: str = "llama", dtype: torch.dtype = torch.float32, seed: int = 0) -> TinyPair:
    """kind: "llama", "qwen2", "llama3" (the first tiny models), or any of `families.KINDS`."""
    if kind not in ("llama", "qwen2", "llama3"):
        hf = families.hf_model(kind, seed)
        config = model_config_from_hf(hf.config)
        loom = build_model(config)
        loom.load_weights(hf.state_dict())
        return TinyPair(hf, loom.to(dtype).eval(), config)
    torch.manual_seed(seed)
    if kind == "qwen2":
        hf_config = transformers.Qwen2Config(**TINY, tie_word_embeddings=True, architectures=["Qwen2ForCausalLM"])
        hf = transformers.Qwen2ForCausalLM(hf_config)
    else:
        scaling = LLAMA3_SCALING if kind == "llama3" else None
        hf_config = transformers.LlamaConfig(**TINY, rope_scaling=scaling, architectures=["LlamaForCausalLM"])
        hf = transformers.LlamaForCausalLM(hf_config)
    hf = hf.eval()
    _randomize_norms(hf)
    config = model_config_from_hf(hf_config)
    loom = build_model(config)
    loom.load_weights(hf.state_dict())
    return TinyPair(hf, loom.to(dtype).eval(), config)


def _randomize_norms(model: torch.nn.Module) -> None:
    # Norm weights start at 1.0; random ones catch a norm applied to the wrong tensor.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.5 * torch.randn_like(p))


@torch.no_grad()
def hf_logits(hf: transformers.PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    """Reference logits for every position of one full sequence: [len, vocab] float32."""
    return hf(torch.tensor([token_ids])).logits[0].float()


def make_cache(model: DecoderModel, block_size: int, num_blocks: int, dtype: torch.dtype = torch.float32) -> PagedKVCache:
    c = model.config
    spec = KVCacheSpec(c.num_layers, model.num_kv_heads, c.head_dim, block_size, dtype)
    return PagedKVCache(spec, num_blocks, num_host_blocks=4, device="cpu")


@dataclass(slots=True)
class SeqChunk:
    token_ids: list[int]
    num_cached: int
    num_compute: int
    block_table: list[int]


@torch.no_grad()
def run_chunks(model: DecoderModel, cache: PagedKVCache, chunks: list[SeqChunk]) -> list[torch.Tensor]:
    """One forward over chunks (prefills first); returns each chunk's logits [num_compute, vocab]."""
    spans = [SeqSpan(c.num_cached, c.num_compute, c.block_table) for c in chunks]
    ids = [t for c in chunks for t in c.token_ids[c.num_cached : c.num_cached + c.num_compute]]
    meta = build_metadata(spans, cache.block_size, torch.device("cpu"))
    hidden = model(torch.tensor(ids), cache.device_blocks, meta)
    logits = model.compute_logits(hidden)
    return list(logits.split([c.num_compute for c in chunks]))


def tiny_runner(pair: TinyPair, block_size: int, num_blocks: int, num_host_blocks: int = 0) -> ModelRunner:
    """A float32 ModelRunner over the pair's Loom model, its KV pool allocated as warmup would."""
    runner = ModelRunner(ShardConfig(model_id="tiny", uds_path="", dtype="float32", block_size=block_size),
                         model=pair.loom)
    with torch.inference_mode():
        runner.allocate_kv_cache(num_blocks=num_blocks, num_host_blocks=num_host_blocks)
    return runner


def random_tokens(n: int, seed: int, vocab: int = TINY["vocab_size"]) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


@pytest.fixture(scope="module")
def llama_pair() -> TinyPair:
    return make_pair("llama")
