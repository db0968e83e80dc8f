"""GGUF loader tests: tiny GGUF files written from random Hugging Face models the way
llama.cpp's convert script writes them, and the embedded model against transformers."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from loom_shard.loading.gguf_reader import read_gguf
from loom_shard.loading.loader import (
    ModelLoadError,
    config_from_hf,
    load_model_config,
    load_model_weights,
    resolve_model_path,
)
from tests.unit.shard.test_loader import TINY

GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def convert_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute, copied as the reference."""
    return (
        weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def gguf_name(hf_name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{GGUF_LAYER_NAMES[rest]}"


def write_tiny_gguf(
    path: Path, arch: str, config: dict, model: torch.nn.Module, tied: bool, extra: dict | None = None
) -> None:
    """Writes the model as convert_hf_to_gguf.py would, in F32; `extra` holds raw GGUF tensors."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name("tiny")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        array = tensor.numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            array = convert_permute(array, config["num_attention_heads"])
        elif arch == "llama" and name.endswith("k_proj.weight"):
            array = convert_permute(array, config["num_key_value_heads"])
        writer.add_tensor(gguf_name(name), np.ascontiguousarray(array))
    for name, array in (extra or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tiny_model(model_class: type, config_class: type, tied: bool, **extra: object) -> torch.nn.Module:
    torch.manual_seed(0)
    return model_class(config_class(**TINY, tie_word_embeddings=tied, **extra)).eval()


@pytest.mark.parametrize(
    ("arch", "model_class", "config_class", "tied"),
    [
        ("llama", LlamaForCausalLM, LlamaConfig, False),
        ("llama", LlamaForCausalLM, LlamaConfig, True),
        ("qwen2", Qwen2ForCausalLM, Qwen2Config, False),
    ],
)
def test_tiny_gguf_loads_back_to_the_model_weights(
    tmp_path: Path, arch: str, model_class: type, config_class: type, tied: bool
) -> None:
    model = tiny_model(model_class, config_class, tied)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, arch, TINY, model, tied)

    config, weights = load_model_weights(str(path), torch.float32, progress=None)

    assert config.architecture == model_class.__name__
    assert config.tie_word_embeddings == tied and config.attention_bias == (arch == "qwen2")
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (2, 4, 2, 8)
    assert config.rope_theta == 50000.0 and config.rms_norm_eps == pytest.approx(1e-6)
    reference = model.state_dict()
    assert set(weights) == set(reference) - ({"lm_head.weight"} if tied else set())
    for name, tensor in weights.items():
        assert torch.equal(tensor, reference[name]), name


def test_tiny_gguf_matches_transformers_gguf_loader(tmp_path: Path) -> None:
    model = tiny_model(LlamaForCausalLM, LlamaConfig, tied=False)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama", TINY, model, tied=False)

    _, weights = load_model_weights(str(path), torch.float32, progress=None)
    reference = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]

    assert set(weights) == set(reference)
    for name, tensor in weights.items():
        assert torch.equal(tensor, reference[name]), name


def llama3_factors(theta: float, head_dim: int, factor: float, low: float, high: float, original: int) -> list[float]:
    """convert_hf_to_gguf.py's Llama-3 rope_freqs loop, as the reference."""
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < original / high:
            factors.append(1.0)
        elif wavelen > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return factors


def test_rope_freqs_tensor_becomes_llama3_rope_scaling(tmp_path: Path) -> None:
    config = {**TINY, "hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1, "rope_theta": 500000.0}
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config)).eval()
    path = tmp_path / "llama3.gguf"
    factors = llama3_factors(500000.0, 128, 8.0, 1.0, 4.0, 8192)
    assert min(factors) == 1.0 and max(factors) == 8.0  # both regimes and the smooth band in between
    assert any(1.0 < f < 8.0 for f in factors)
    rope_freqs = {"rope_freqs.weight": np.array(factors, dtype=np.float32)}
    write_tiny_gguf(path, "llama", config, model, tied=False, extra=rope_freqs)

    loaded = load_model_config(str(path))

    assert loaded.rope_scaling is not None
    assert (loaded.rope_scaling.factor, loaded.rope_scaling.low_freq_factor) == (8.0, 1.0)
    assert (loaded.rope_scaling.high_freq_factor, loaded.rope_scaling.original_max_position_embeddings) == (4.0, 8192)


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"gpt2\.gguf.*unsupported GGUF architecture 'gpt2'"):
        load_model_config(str(path))


@pytest.mark.slow
def test_embedded_gguf_weights_equal_transformers() -> None:
    path = resolve_model_path("")
    hf_config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    # from_pretrained(gguf_file=...) needs accelerate, which is not installed; this is the same
    # conversion it runs: transformers' own GGUF reader, dequantizer and Q/K un-permutation.
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    reference = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]

    config, weights = load_model_weights("", torch.float32, progress=None)

    assert config == config_from_hf(hf_config.to_dict())
    assert set(weights) == set(reference)
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, reference[name]), name


def test_lean_reader_agrees_with_gguf_package_reader(tmp_path: Path) -> None:
    path = tmp_path / "mixed.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint32("test.u32", 7)
    writer.add_float64("test.f64", 0.25)
    writer.add_bool("test.flag", True)
    writer.add_array("test.ints", [1, -2, 3])
    writer.add_token_list(["a", "bc", "déf"])
    writer.add_tensor("a.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("b.weight", np.ones((2, 64), dtype=np.float16))
    q8 = gguf.GGMLQuantizationType.Q8_0
    writer.add_tensor("c.weight", gguf.quants.quantize(np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32), q8), raw_dtype=q8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    lean = read_gguf(path)
    reference = gguf.GGUFReader(path)

    assert (lean.metadata["test.u32"], lean.metadata["test.f64"], lean.metadata["test.flag"]) == (7, 0.25, True)
    assert list(lean.metadata["test.ints"]) == [1, -2, 3]
    assert len(lean.metadata["tokenizer.ggml.tokens"]) == 3
    assert lean.metadata["general.architecture"] == "llama"
    for tensor in reference.tensors:
        info = lean.tensors[tensor.name]
        assert (info.offset, info.num_bytes, info.tensor_type) == (tensor.data_offset, tensor.n_bytes, tensor.tensor_type)
        assert info.shape == tuple(int(d) for d in tensor.shape)
        assert np.array_equal(lean.raw_data(info).view(np.uint8).reshape(-1), tensor.data.view(np.uint8).reshape(-1))
