"""Loads a GGUF file: its metadata into a ModelConfig, its tensors dequantized into a state dict
with Hugging Face names and shapes (`gguf_arch` says where each lies and what to undo)."""

from __future__ import annotations

import logging
import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from loom_shard.layers.quant_linear import KEPT_AS, QuantKind, QuantSource, convert_rows, raw_source
from loom_shard.loading import gguf_arch
from loom_shard.loading.common import (
    LoadProgress,
    ModelLoadError,
    Part,
    PartFn,
    ProgressFn,
    check_shape,
    expected_shapes,
)
from loom_shard.loading.gguf_arch import Combine, Metadata, Recipe
from loom_shard.loading.gguf_reader import GGUFFile, GGUFFormatError, TensorInfo, read_gguf
from loom_shard.model_config import Llama3Scaling, LongRopeScaling, ModelConfig

ROPE_FREQS_NAME = "rope_freqs.weight"  # llama.cpp's form of Llama-3 rope scaling
ROPE_FACTORS = ("rope_factors_short.weight", "rope_factors_long.weight")  # Phi-3's LongRoPE

log = logging.getLogger(__name__)


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
    if arch not in gguf_arch.ARCHITECTURES:
        raise ModelLoadError(path, f"unsupported GGUF architecture {arch!r}; supported: "
                             f"{', '.join(gguf_arch.ARCHITECTURES)}")
    tensors = reader.tensors
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(path, "missing tensor token_embd.weight")
    hidden_size = int(_field(reader, f"{arch}.embedding_length", path))
    num_heads = int(_field(reader, f"{arch}.attention.head_count", path))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", path, hidden_size // num_heads))
    rope_theta = float(_field(reader, f"{arch}.rope.freq_base", path, 10000.0))
    rotary_dim = int(_field(reader, f"{arch}.rope.dimension_count", path, head_dim))
    meta = Metadata(reader.metadata, arch)
    try:
        base = ModelConfig(
            architecture=gguf_arch.ARCHITECTURES[arch],
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
            rope_scaling=_rope_scaling(path, reader, meta, rope_theta, rotary_dim),
            rotary_dim=rotary_dim if rotary_dim != head_dim else None,
            tie_word_embeddings="output.weight" not in tensors,
        )
        return gguf_arch.family_config(meta, base)
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


def _rope_scaling(path: Path, reader: GGUFFile, meta: Metadata, rope_theta: float,
                  rotary_dim: int) -> Llama3Scaling | LongRopeScaling | gguf_arch.LinearScaling | gguf_arch.YarnScaling | None:
    freqs = reader.tensors.get(ROPE_FREQS_NAME)
    if freqs is not None:
        return _llama3_scaling(path, reader, freqs, rope_theta, rotary_dim)
    if all(name in reader.tensors for name in ROPE_FACTORS):
        return _longrope(path, reader, meta)
    return gguf_arch.rope_scaling(meta)


def _llama3_scaling(path: Path, reader: GGUFFile, freqs_tensor: TensorInfo, rope_theta: float,
                    head_dim: int) -> Llama3Scaling:
    """Recovers Llama-3 rope scaling from the per-frequency factors llama.cpp stores instead."""
    factors = dequantize(reader.raw_data(freqs_tensor), freqs_tensor.tensor_type).reshape(-1).astype(np.float64)
    factor = float(factors.max())
    for low, high, original in _LLAMA3_CANDIDATES:
        expected = llama3_rope_factors(rope_theta, head_dim, factor, low, high, original)
        if expected.shape == factors.shape and np.allclose(expected, factors, rtol=1e-4):
            return Llama3Scaling(factor, low, high, original)
    raise ModelLoadError(path, f"{ROPE_FREQS_NAME} does not match Llama-3 rope scaling")


def _longrope(path: Path, reader: GGUFFile, meta: Metadata) -> LongRopeScaling:
    short, long = (tuple(float(f) for f in dequantize(reader.raw_data(reader.tensors[name]),
                                                      reader.tensors[name].tensor_type).reshape(-1))
                   for name in ROPE_FACTORS)
    context = int(meta.get("context_length", 2048))
    original = int(meta.get("rope.scaling.original_context_length") or context)
    attention = meta.get("rope.scaling.attn_factor")
    if attention is None:
        scale = context / original
        attention = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
    return LongRopeScaling(short, long, original, context, float(attention))


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

    quantized: when given, projection weights in a kept format (Q4_1, Q8_0, and the formats
    KEPT_AS converts), experts' too, go there as raw blocks instead (Q/K rows
    unpermuted), and a tied embedding also goes there as "lm_head.weight".
    """
    shapes = expected_shapes(config)
    arch = str(reader.metadata["general.architecture"])
    recipes = _recipes(path, reader, arch, shapes)
    report = LoadProgress(path, len(shapes), progress)
    tensors: dict[str, torch.Tensor] = {}
    not_kept: Counter[str] = Counter()  # quantized projections in a format QuantLinear does not run
    for done, (name, shape) in enumerate(shapes.items(), start=1):
        recipe = recipes[name]
        if recipe.combine is Combine.ONE:
            tensor = reader.tensors[recipe.sources[0]]
            check_shape(path, name, _hf_shape(tensor, recipe), shape)
            keep = quantized is not None and not recipe.shift and _keeps_quantized(name, config)
            source = quant_source(tensor, reader, recipe.expert) if keep else None
            if source is not None:
                target = "lm_head.weight" if name == "model.embed_tokens.weight" else name
                quantized[target] = _unpermute_source(recipe, source, config)
                if target == name:
                    report.tensor_done(done)
                    continue
            elif keep and GGML_QUANT_SIZES[tensor.tensor_type][0] > 1:  # a block format, not F32/F16/BF16
                not_kept[tensor.tensor_type.name] += 1
        cut = part(name, shape) if part else None
        tensors[name] = _read(path, reader, recipe, shape, dtype, cut, config)
        report.tensor_done(done)
    report.finish(tensors)
    if not_kept:
        log.info("%s: %s dequantized to %s (formats the quantized kernels do not run)", path.name,
                 ", ".join(f"{kind} x{count}" for kind, count in sorted(not_kept.items())), str(dtype).removeprefix("torch."))
    return tensors


def _recipes(path: Path, reader: GGUFFile, arch: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, Recipe]:
    """Every tensor's recipe; ModelLoadError naming the first missing ones, before any is read."""
    recipes, missing = {}, []
    for name in shapes:
        recipe = gguf_arch.recipe(arch, name)
        if recipe is None or any(source not in reader.tensors for source in recipe.sources):
            missing.append(recipe.sources[0] if recipe else name)
            continue
        recipes[name] = recipe
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ModelLoadError(path, f"missing tensor(s) {shown}")
    return recipes


def _hf_shape(tensor: TensorInfo, recipe: Recipe) -> tuple[int, ...]:
    """The Hugging Face shape of what `recipe` reads from a tensor (one expert of a stacked one)."""
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return shape[1:] if recipe.expert is not None else shape


def _read(path: Path, reader: GGUFFile, recipe: Recipe, shape: tuple[int, ...], dtype: torch.dtype,
          cut: Part | None, config: ModelConfig) -> torch.Tensor:
    if recipe.combine is not Combine.ONE:
        whole = _combine(recipe, [_to_torch(path, reader, reader.tensors[s], dtype, None, None) for s in recipe.sources])
        if tuple(whole.shape) != tuple(shape):
            raise ModelLoadError(path, f"{recipe.sources} make a tensor of shape {list(whole.shape)}, "
                                 f"the config needs {list(shape)}")
        return cut.take(whole) if cut else whole
    tensor = reader.tensors[recipe.sources[0]]
    weight = _to_torch(path, reader, tensor, dtype, cut, recipe.expert).reshape(cut.shape_of(shape) if cut else shape)
    if recipe.unpermute:
        weight = _unpermute_qk(weight, config)
    if recipe.shift:
        weight = (weight.float() - recipe.shift).to(dtype)
    return weight


def _combine(recipe: Recipe, parts: list[torch.Tensor]) -> torch.Tensor:
    """gpt-oss's experts back in the Hugging Face checkpoint's layout."""
    if recipe.combine is Combine.INTERLEAVE_GATE_UP:  # gate, up [E, I, H] -> [E, H, 2I], gate at even columns
        gate, up = parts
        return torch.stack([gate, up], dim=2).flatten(1, 2).transpose(1, 2).contiguous()
    if recipe.combine is Combine.INTERLEAVE_BIAS:  # [E, I] x 2 -> [E, 2I]
        return torch.stack(parts, dim=2).flatten(1, 2)
    assert recipe.combine is Combine.TRANSPOSE
    return parts[0].transpose(1, 2).contiguous()


def quant_source(tensor: TensorInfo, reader: GGUFFile, expert: int | None = None) -> QuantSource | None:
    """The tensor's raw blocks (one expert's, of a stacked tensor) when its format is one QuantLinear
    runs (or converts to one exactly: KEPT_AS), else None."""
    name = tensor.tensor_type.name
    kind, convert = KEPT_AS.get(name, (QuantKind.__members__.get(name), None))
    if kind is None or len(tensor.shape) != (2 if expert is None else 3):
        return None
    raw = reader.raw_data(tensor)
    if expert is not None:
        rows = int(tensor.shape[1])
        raw = raw[expert * rows : (expert + 1) * rows]
    if convert is None:
        return raw_source(kind, raw, int(tensor.shape[0]))
    converted = convert_rows(convert, raw)
    return None if converted is None else raw_source(kind, converted, int(tensor.shape[0]), file_kind=name)


def _keeps_quantized(name: str, config: ModelConfig) -> bool:
    if name == "model.embed_tokens.weight":  # looked up dequantized; the tied head multiplies quantized
        return config.tie_word_embeddings
    if ".experts." in name:  # one expert's projection (Mixtral, Qwen3-MoE)
        return name.endswith(".weight")
    return name.endswith("_proj.weight") or name == "lm_head.weight"


def _unpermute_source(recipe: Recipe, source: QuantSource, config: ModelConfig) -> QuantSource:
    if not recipe.unpermute:
        return source
    # Whole rows of blocks move, so the row permutation applies to the raw bytes unchanged.
    return QuantSource(source.kind, _unpermute_qk(source.raw, config).contiguous(), source.in_features, source.file_kind)


def _to_torch(path: Path, reader: GGUFFile, tensor: TensorInfo, dtype: torch.dtype, cut: Part | None,
              expert: int | None) -> torch.Tensor:
    """The tensor (its `expert`'s slice when given) dequantized to `dtype`, cut to `cut`."""
    raw = reader.raw_data(tensor)
    shape = tensor.shape[::-1]
    if expert is not None:  # [experts x rows, bytes per row]: one expert's rows
        rows = int(tensor.shape[1])
        raw, shape = raw[expert * rows : (expert + 1) * rows], shape[1:]
    raw, rest = _raw_part(raw, len(shape), tensor, cut)
    try:
        array = dequantize(raw, tensor.tensor_type)
    except (NotImplementedError, ValueError) as error:
        raise ModelLoadError(path, f"cannot dequantize {tensor.name} ({tensor.tensor_type.name}): {error}") from None
    if not array.flags.writeable:  # an unquantized tensor is a view of the read-only memory map
        array = array.copy()
    weight = torch.from_numpy(array).to(dtype)
    if rest is not None:
        return rest.take(weight.reshape(shape))
    return weight.reshape(cut.shape_of(shape) if cut else shape)  # cut already (raw rows or blocks)


def _raw_part(raw: np.ndarray, ndim: int, tensor: TensorInfo, cut: Part | None) -> tuple[np.ndarray, Part | None]:
    """The raw rows / blocks of a 2-D tensor holding `cut` ([rows, bytes per row] as gguf's
    dequantize takes them), and what is left to cut after dequantizing (a cut inside a quantization
    block, another shape)."""
    if cut is None or ndim != 2:
        return raw, cut
    if cut.dim == 0:  # whole rows: only their bytes are read from the memory map
        return raw[cut.start : cut.stop], None
    block_size, type_size = GGML_QUANT_SIZES[tensor.tensor_type]
    if cut.start % block_size or cut.stop % block_size:
        return raw, cut
    # columns: the same run of blocks out of every row
    start, stop = cut.start // block_size * type_size, cut.stop // block_size * type_size
    return np.ascontiguousarray(raw[:, start:stop]), None


def _unpermute_qk(weight: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """Undoes convert_hf_to_gguf.py's permute, which interleaves each head's rotary halves."""
    rows, cols = weight.shape
    num_heads = rows // config.head_dim  # a tensor-parallel rank reads whole heads: fewer of them
    # [heads, head_dim/2, 2, cols] (GGUF order) -> [heads, 2, head_dim/2, cols] (Hugging Face order)
    return weight.reshape(num_heads, rows // num_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)
