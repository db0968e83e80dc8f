"""GGUF files of every family, written as llama.cpp's convert script writes them, load into the
model transformers runs (logits within 1e-4); a GGUF's Q8_0 / Q4_1 experts run quantized on Loom's
kernels, close to the same weights dequantized."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch

from loom_proto.config import ShardConfig
from loom_shard.layers.moe import QuantExperts
from loom_shard.loading.loader import load_model_weights
from loom_shard.loading.quantize import quantized_summary
from loom_shard.models import build_model
from loom_shard.runtime.runner import ModelRunner
from tests.unit.shard import families
from tests.unit.shard.conftest import SeqChunk, hf_logits, make_cache, random_tokens, run_chunks
from tests.unit.shard.gguf_files import write_family_gguf
from tests.unit.shard.test_families import assert_close

# llama.cpp keeps no query_pre_attn_scalar: its Gemma GGUFs scale by 1 / sqrt(head_dim), as the
# released models (but the 27B ones) do; its qwen3moe has experts in every layer, as the released ones.
GGUF_OVERRIDES = {"gemma2": {"query_pre_attn_scalar": 16}, "qwen3_moe": {"mlp_only_layers": []}}
KINDS = ["qwen3", "qwen3_moe", "mixtral", "gemma2", "gemma3", "phi3", "gpt_oss"]


def _logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    cache = make_cache(model, block_size=4, num_blocks=16, dtype=next(model.parameters()).dtype)
    chunks = [SeqChunk(tokens, 0, len(tokens) - 1, list(range(12)))]
    first = run_chunks(model, cache, chunks)[0]
    last = run_chunks(model, cache, [SeqChunk(tokens, len(tokens) - 1, 1, list(range(12)))])[0]
    return torch.cat([first, last]).float()


@pytest.mark.parametrize("kind", KINDS)
def test_family_gguf_matches_transformers(tmp_path: Path, kind: str) -> None:
    hf = families.hf_model(kind, **GGUF_OVERRIDES.get(kind, {}))
    path = tmp_path / f"{kind}.gguf"
    write_family_gguf(path, kind, hf)
    config, weights = load_model_weights(str(path), torch.float32, progress=None)
    assert config.architecture == families.ARCHITECTURE[kind]
    model = build_model(config)
    model.load_weights(weights)
    tokens = random_tokens(41, 8)
    assert_close(_logits(model.eval(), tokens), hf_logits(hf, tokens))


K_WIDTHS = {"hidden_size": 256, "intermediate_size": 256, "moe_intermediate_size": 256}  # K-quants: 256 a block


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize(("kind_of_experts", "runs_as"), [(gguf.GGMLQuantizationType.Q8_0, "Q8_0"),
                                                         (gguf.GGMLQuantizationType.Q4_1, "Q4_1"),
                                                         (gguf.GGMLQuantizationType.Q4_0, "Q4_1"),
                                                         (gguf.GGMLQuantizationType.Q5_0, "Q8_0"),
                                                         (gguf.GGMLQuantizationType.Q5_1, "Q8_M"),
                                                         (gguf.GGMLQuantizationType.Q4_K, "Q4_1"),
                                                         ("Q4_K_M", "Q4_1")])  # Q4_K, down Q6_K
def test_quantized_experts_run_quantized_close_to_dequantized(tmp_path: Path, kind: str,
                                                              kind_of_experts: gguf.GGMLQuantizationType | str,
                                                              runs_as: str) -> None:
    path = tmp_path / f"{kind}.gguf"
    q4_k_m = kind_of_experts == "Q4_K_M"
    k_quant = q4_k_m or kind_of_experts is gguf.GGMLQuantizationType.Q4_K
    widths = K_WIDTHS if k_quant else {}
    hf = families.hf_model(kind, **GGUF_OVERRIDES.get(kind, {}), **widths)
    Q4_K, Q6_K = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K
    write_family_gguf(path, kind, hf, experts_as=Q4_K if q4_k_m else kind_of_experts,
                      down_experts_as=Q6_K if q4_k_m else None)
    models = {}
    for flag in ("auto", "none"):
        config = ShardConfig(model_id=str(path), uds_path="", dtype="float32", quantize=flag, block_size=16)
        models[flag] = ModelRunner(config).model
    quantized, reference = models["auto"], models["none"]
    experts = [m for m in quantized.modules() if isinstance(m, QuantExperts)]
    num_moe_layers = sum(1 for i in range(quantized.config.num_layers) if quantized.config.is_moe_layer(i))
    assert len(experts) == num_moe_layers and experts[0].up[0].kind.name == runs_as
    assert experts[0].down[0].kind.name == ("Q8_16" if q4_k_m else runs_as)
    assert runs_as in quantized_summary(quantized) and quantized_summary(reference) == "none"
    tokens = random_tokens(41, 9)
    got, expected = _logits(quantized, tokens), _logits(reference, tokens)
    # The same quantized weights; the kernels quantize activations to int8 per block of 32 as
    # llama.cpp does: measured 0.7-2.7% of the largest logit on these heavy-tailed random models,
    # but for a token whose router picks another expert (a near-tie) now and then. A wrong expert
    # or a misplaced gate/up gives errors of the logits' own size on every token.
    # The 256-wide models (K-quants) sum 4x the terms a logit: medians 1.3-2.1% for Q4_1, Q8_0 and
    # Q4_K experts alike, more tokens near a tie.
    row_errors = (got - expected).abs().max(-1).values / expected.abs().max()
    assert (row_errors < (5e-2 if widths else 3e-2)).float().mean() >= 0.9, row_errors


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_quantized_experts_match_the_modules_bit_for_bit(tmp_path: Path, dtype: str) -> None:
    """loom::moe_experts runs QuantExperts in one C++ call; it must change no bit."""
    path = tmp_path / "mixtral.gguf"
    write_family_gguf(path, "mixtral", families.hf_model("mixtral"), experts_as=gguf.GGMLQuantizationType.Q8_0)
    config = ShardConfig(model_id=str(path), uds_path="", dtype=dtype, quantize="auto", block_size=16)
    model = ModelRunner(config).model
    experts = [m for m in model.modules() if isinstance(m, QuantExperts)]
    assert experts and all(e.fused for e in experts)
    tokens = random_tokens(41, 11)
    fused = _logits(model, tokens)
    for e in experts:
        e.use_fused = False
    assert torch.equal(_logits(model, tokens), fused)
