"""Loads a GGUF file: its metadata into a ModelConfig, its tensors dequantized into
a state dict with Hugging Face names and shapes (undoing llama.cpp's Q/K row permutation)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from loom_shard.gguf_reader import GGUFFile, GGUFFormatError, TensorInfo, read_gguf
from loom_shard.layers.quant_linear import QuantKind, QuantSource, raw_source
from loom_shard.loader_common import (
    LoadProgress,
    ModelLoadError,
    Part,
    PartFn,
    ProgressFn,
    check_names,
    check_shape,
    expected_shapes,
)
from loom_shard.model_config import Llama3Scaling, ModelConfig

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
ROPE_FREQS_NAME = "rope_freqs.weight"  # llama.cpp's form of Llama-3 rope scaling


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for tensors the model does not take."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)  # "blk", "<i>", "<rest>"
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def open_gguf(path: Path) -> GGUFFile:
    """The file's metadata and tensor directory; ModelLoadError for anything that is not a sound GGUF."""
    try:
        return read_gguf(path)
    except GGUFFormatError as error:
        raise ModelLoadError(path, str(error)) from None
    except OSError as error:
        raise ModelLoadError(path, f"unreadable file: {error.strerror or error}") from None


def gguf_config(path: Path, reader: GGUFFile) -> ModelConfig:
    """The ModelConfig that a GGUF file's metadata and tensor list describe."""
    arch = str(_field(reader, "general.architecture", path))
    if arch not in _ARCHITECTURES:
        raise ModelLoadError(path, f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_ARCHITECTURES)}")
    tensors = reader.tensors
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(path, "missing tensor token_embd.weight")
    hidden_size = int(_field(reader, f"{arch}.embedding_length", path))
    num_heads = int(_field(reader, f"{arch}.attention.head_count", path))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", path, hidden_size // num_heads))
    rope_theta = float(_field(reader, f"{arch}.rope.freq_base", path, 10000.0))
    _reject_unsupported_rope(path, reader, arch, head_dim)
    try:
        return ModelConfig(
            architecture=_ARCHITECTURES[arch],
            vocab_size=_vocab_size(path, reader, arch, tensors["token_embd.weight"]),
            hidden_size=hidden_size,
            intermediate_size=int(_field(reader, f"{arch}.feed_forward_length", path)),
            num_layers=int(_field(reader, f"{arch}.block_count", path)),
            num_heads=num_heads,
            num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", path, num_heads)),
            head_dim=head_dim,
            max_position_embeddings=int(_field(reader, f"{arch}.context_length", path, 2048)),
            rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", path, 1e-5)),
            rope_theta=rope_theta,
            rope_scaling=_rope_scaling(path, reader, tensors.get(ROPE_FREQS_NAME), rope_theta, head_dim),
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias=arch == "qwen2",
        )
    except ValueError as error:
        raise ModelLoadError(path, f"invalid model metadata: {error}") from None


_REQUIRED = object()


def _field(reader: GGUFFile, key: str, path: Path, default: Any = _REQUIRED) -> Any:
    if key in reader.metadata:
        return reader.metadata[key]
    if default is _REQUIRED:
        raise ModelLoadError(path, f"GGUF metadata lacks the key {key}")
    return default


def _vocab_size(path: Path, reader: GGUFFile, arch: str, embedding: TensorInfo) -> int:
    # The embedding's row count is what the model needs; the metadata must agree with it.
    rows = int(embedding.shape[-1])  # GGUF lists dims innermost first: [hidden, vocab]
    declared = _field(reader, f"{arch}.vocab_size", path, None)
    if declared is None:
        tokens = reader.metadata.get("tokenizer.ggml.tokens")
        declared = len(tokens) if tokens is not None else rows
    if int(declared) != rows:
        raise ModelLoadError(path, f"vocab size {declared} in the metadata, but token_embd.weight has {rows} rows")
    return rows


def _reject_unsupported_rope(path: Path, reader: GGUFFile, arch: str, head_dim: int) -> None:
    scaling_type = _field(reader, f"{arch}.rope.scaling.type", path, "none")
    if scaling_type not in ("none", None):
        raise ModelLoadError(path, f"unsupported rope scaling type {scaling_type!r}")
    rope_dims = int(_field(reader, f"{arch}.rope.dimension_count", path, head_dim))
    if rope_dims != head_dim:
        raise ModelLoadError(path, f"unsupported partial rotary embedding ({rope_dims} of {head_dim} dims)")


def _rope_scaling(
    path: Path, reader: GGUFFile, freqs_tensor: TensorInfo | None, rope_theta: float, head_dim: int
) -> Llama3Scaling | None:
    """Recovers Llama-3 rope scaling from the per-frequency factors llama.cpp stores instead."""
    if freqs_tensor is None:
        return None
    factors = dequantize(reader.raw_data(freqs_tensor), freqs_tensor.tensor_type).reshape(-1).astype(np.float64)
    factor = float(factors.max())
    for low, high, original in _LLAMA3_CANDIDATES:
        expected = llama3_rope_factors(rope_theta, head_dim, factor, low, high, original)
        if expected.shape == factors.shape and np.allclose(expected, factors, rtol=1e-4):
            return Llama3Scaling(factor, low, high, original)
    raise ModelLoadError(path, f"{ROPE_FREQS_NAME} does not match Llama-3 rope scaling")


# (low_freq_factor, high_freq_factor, original_max_position_embeddings) seen in released Llama-3 models.
_LLAMA3_CANDIDATES = [(1.0, 4.0, 8192), (1.0, 4.0, 4096), (1.0, 4.0, 16384), (1.0, 2.0, 8192), (2.0, 4.0, 8192)]


def llama3_rope_factors(
    theta: float, head_dim: int, factor: float, low: float, high: float, original: int
) -> np.ndarray:
    """The divisors of each rotary frequency, as llama.cpp's convert script writes them."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelens = 2 * math.pi / freqs
    smooth = (original / wavelens - low) / (high - low)
    factors = 1.0 / ((1 - smooth) / factor + smooth)
    factors = np.where(wavelens < original / high, 1.0, factors)
    return np.where(wavelens > original / low, factor, factors)


def load_gguf_weights(
    path: Path, reader: GGUFFile, config: ModelConfig, dtype: torch.dtype, progress: ProgressFn | None,
    part: PartFn | None = None, quantized: dict[str, QuantSource] | None = None,
) -> dict[str, torch.Tensor]:
    """Dequantizes tensor by tensor, converting each to `dtype` at once to bound peak memory;
    where `part` names a part of a tensor, only that part's blocks are read and dequantized.

    quantized: when given, projection weights in a kept format (Q4_1, Q8_0) go there as raw blocks
    instead (Q/K rows unpermuted), and a tied embedding also goes there as "lm_head.weight".
    """
    shapes = expected_shapes(config)
    by_hf_name = {hf_name(name): tensor for name, tensor in reader.tensors.items()}
    check_names(path, config, by_hf_name)
    report = LoadProgress(path, len(shapes), progress)
    tensors: dict[str, torch.Tensor] = {}
    for done, (name, shape) in enumerate(shapes.items(), start=1):
        tensor = by_hf_name[name]
        check_shape(path, name, tuple(int(d) for d in reversed(tensor.shape)), shape)
        source = quant_source(tensor, reader) if quantized is not None else None
        if source is not None and _keeps_quantized(name, config):
            target = "lm_head.weight" if name == "model.embed_tokens.weight" else name
            quantized[target] = _unpermute_qk_source(name, source, config)
            if target == name:
                report.tensor_done(done)
                continue
        cut = part(name, shape) if part else None
        weight = _to_torch(path, reader, tensor, dtype, cut).reshape(cut.shape_of(shape) if cut else shape)
        if config.architecture == "LlamaForCausalLM":
            weight = _unpermute_qk(name, weight, config)
        tensors[name] = weight
        report.tensor_done(done)
    report.finish(tensors)
    return tensors


def quant_source(tensor: TensorInfo, reader: GGUFFile) -> QuantSource | None:
    """The tensor's raw blocks when its format is one QuantLinear runs, else None."""
    kind = QuantKind.__members__.get(tensor.tensor_type.name)
    if kind is None or len(tensor.shape) != 2:
        return None
    return raw_source(kind, reader.raw_data(tensor), int(tensor.shape[0]))


def _keeps_quantized(name: str, config: ModelConfig) -> bool:
    if name == "model.embed_tokens.weight":  # looked up dequantized; the tied head multiplies quantized
        return config.tie_word_embeddings
    return name.endswith("_proj.weight") or name == "lm_head.weight"


def _unpermute_qk_source(name: str, source: QuantSource, config: ModelConfig) -> QuantSource:
    if config.architecture != "LlamaForCausalLM":
        return source
    # Whole rows of blocks move, so the row permutation applies to the raw bytes unchanged.
    return QuantSource(source.kind, _unpermute_qk(name, source.raw, config).contiguous(), source.in_features)


def _to_torch(path: Path, reader: GGUFFile, tensor: TensorInfo, dtype: torch.dtype, cut: Part | None) -> torch.Tensor:
    raw, rest = _raw_part(reader.raw_data(tensor), tensor, cut)
    try:
        array = dequantize(raw, tensor.tensor_type)
    except (NotImplementedError, ValueError) as error:
        raise ModelLoadError(path, f"cannot dequantize {tensor.name} ({tensor.tensor_type.name}): {error}") from None
    if not array.flags.writeable:  # an unquantized tensor is a view of the read-only memory map
        array = array.copy()
    weight = torch.from_numpy(array).to(dtype)
    return rest.take(weight.reshape(tensor.shape[::-1])) if rest else weight


def _raw_part(raw: np.ndarray, tensor: TensorInfo, cut: Part | None) -> tuple[np.ndarray, Part | None]:
    """The raw rows / blocks holding `cut` ([rows, bytes per row] as gguf's dequantize takes them),
    and what is left to cut after dequantizing (a cut inside a quantization block, a 1-D tensor)."""
    if cut is None or len(tensor.shape) != 2:
        return raw, cut
    if cut.dim == 0:  # whole rows: only their bytes are read from the memory map
        return raw[cut.start : cut.stop], None
    block_size, type_size = GGML_QUANT_SIZES[tensor.tensor_type]
    if cut.start % block_size or cut.stop % block_size:
        return raw, cut
    # columns: the same run of blocks out of every row
    start, stop = cut.start // block_size * type_size, cut.stop // block_size * type_size
    return np.ascontiguousarray(raw[:, start:stop]), None


def _unpermute_qk(name: str, weight: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """Undoes convert_hf_to_gguf.py's permute, which interleaves each head's rotary halves."""
    if not name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
        return weight
    rows, cols = weight.shape
    num_heads = rows // config.head_dim  # a tensor-parallel rank reads whole heads: fewer of them
    # [heads, head_dim/2, 2, cols] (GGUF order) -> [heads, 2, head_dim/2, cols] (Hugging Face order)
    return weight.reshape(num_heads, rows // num_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)
