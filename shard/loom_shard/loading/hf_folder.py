"""Loads a Hugging Face model folder: config.json into a ModelConfig, and
*.safetensors (single file or sharded with an index) into a state dict."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from loom_shard.loading.common import (
    LoadProgress,
    ModelLoadError,
    Part,
    PartFn,
    ProgressFn,
    check_names,
    check_shape,
    expected_shapes,
)
from loom_shard.loading.mxfp4 import dequantize_experts
from loom_shard.model_config import (
    DynamicScaling,
    LayerKind,
    LinearScaling,
    Llama3Scaling,
    LongRopeScaling,
    ModelConfig,
    RopeScaling,
    YarnScaling,
)
from loom_shard.models import TEXT_PARTS, family, supported_architectures, unsupported_message

INDEX_FILE_NAME = "model.safetensors.index.json"
# A multimodal checkpoint's text model tensors, under either of transformers' layouts -> Loom's names.
_TEXT_MODEL_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                        ("language_model.lm_head.", "lm_head."))
# A base model's tensors (an embedding model's checkpoint: no "model." prefix) -> Loom's names.
_BASE_MODEL_PREFIXES = (("embed_tokens.", "model.embed_tokens."), ("layers.", "model.layers."),
                        ("norm.", "model.norm."))
# Base models without an LM head (sentence-transformers' embedding checkpoints): served as their
# causal LM with the head tied to the embeddings (only embeddings mean anything then).
_BASE_MODELS = {"LlamaModel": "LlamaForCausalLM", "MistralModel": "MistralForCausalLM",
                "Qwen2Model": "Qwen2ForCausalLM", "Qwen3Model": "Qwen3ForCausalLM",
                "Gemma2Model": "Gemma2ForCausalLM", "Gemma3TextModel": "Gemma3ForCausalLM",
                "Phi3Model": "Phi3ForCausalLM"}
_ARCHITECTURE_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}


def config_from_hf(config: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """A ModelConfig from a parsed config.json; raises ModelLoadError naming `source`."""
    config = _base_model(_text_part(config))
    architecture = _architecture(config, source)
    _reject_unsupported_features(config, architecture, source)
    try:
        num_heads = int(config["num_attention_heads"])
        hidden_size = int(config["hidden_size"])
        head_dim = config.get("head_dim") or hidden_size // num_heads  # null in some configs
        num_layers = int(config["num_hidden_layers"])
        # transformers >= 5 writes theta and scaling together as "rope_parameters".
        rope = config.get("rope_parameters") or {}
        max_positions = int(config.get("max_position_embeddings", 2048))
        base = ModelConfig(
            architecture=architecture,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            max_position_embeddings=max_positions,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(config.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rope_scaling=_rope_scaling(config.get("rope_scaling") or rope, config, source),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            sliding_window=_sliding_window(config),
            layer_kinds=_layer_kinds(config, num_layers),
        )
        return family(architecture).config_from_hf(config, base)
    except KeyError as error:
        raise ModelLoadError(source, f"config is missing the key {error.args[0]!r}") from None
    except (TypeError, ValueError) as error:
        raise ModelLoadError(source, f"invalid config: {error}") from None


def _text_part(config: dict[str, Any]) -> dict[str, Any]:
    """A multimodal checkpoint's config -> its text model's (TEXT_PARTS); any other unchanged."""
    for name in config.get("architectures") or []:
        part = TEXT_PARTS.get(name)
        if part is not None:
            return {**part.defaults, **(config.get("text_config") or {}), "architectures": [part.architecture]}
    return config


def _base_model(config: dict[str, Any]) -> dict[str, Any]:
    """A headless base model's config (`_BASE_MODELS`) -> its causal LM's, the head tied; any other unchanged."""
    for name in config.get("architectures") or []:
        if name in _BASE_MODELS:
            return {**config, "architectures": [_BASE_MODELS[name]], "tie_word_embeddings": True}
    return config


def _architecture(config: dict[str, Any], source: str) -> str:
    architectures = config.get("architectures") or []
    known = supported_architectures()
    for name in architectures:
        if name in known:
            return name
    if not architectures and config.get("model_type") in _ARCHITECTURE_BY_MODEL_TYPE:
        return _ARCHITECTURE_BY_MODEL_TYPE[config["model_type"]]
    found = ", ".join(architectures) or f"model_type {config.get('model_type')!r}"
    raise ModelLoadError(source, unsupported_message(found))


# Llama-named architectures whose attention_bias means q/k/v biases only (others: o_proj's too).
_QKV_BIAS_ONLY = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM")


def _reject_unsupported_features(config: dict[str, Any], architecture: str, source: str) -> None:
    # Llama's attention_bias also adds an o_proj bias, and mlp_bias biases the MLP: the model has neither.
    if architecture not in _QKV_BIAS_ONLY and config.get("attention_bias"):
        raise ModelLoadError(source, f"unsupported: attention_bias=true for {architecture}")
    if config.get("mlp_bias"):
        raise ModelLoadError(source, "unsupported: mlp_bias=true")
    method = (config.get("quantization_config") or {}).get("quant_method")
    if method not in (None, "mxfp4"):
        raise ModelLoadError(source, f"unsupported quantization_config quant_method {method!r} (Loom reads "
                             "unquantized safetensors, gpt-oss's MXFP4 experts, and GGUF files)")
    if config.get("use_bidirectional_attention"):
        raise ModelLoadError(source, "unsupported: use_bidirectional_attention=true (an encoder, not a decoder)")


def _sliding_window(config: dict[str, Any]) -> int | None:
    """The window of the sliding layers; None when no layer slides (Qwen's use_sliding_window false)."""
    if config.get("use_sliding_window") is False:
        return None
    window = config.get("sliding_window")
    return int(window) if window else None


def _layer_kinds(config: dict[str, Any], num_layers: int) -> tuple[LayerKind, ...] | None:
    kinds = config.get("layer_types")
    if not kinds:
        return None
    if len(kinds) != num_layers:
        raise ValueError(f"layer_types lists {len(kinds)} layers, the model has {num_layers}")
    try:
        return tuple(LayerKind(kind) for kind in kinds)
    except ValueError:
        raise ValueError(f"unsupported layer_types {sorted(set(kinds))} (sliding_attention, full_attention)") from None


_ROPE_TYPES = ("llama3", "linear", "dynamic", "yarn", "longrope", "su")


def _rope_scaling(scaling: dict[str, Any] | None, config: dict[str, Any], source: str) -> RopeScaling | None:
    """The config's rope scaling; config gives the context lengths some kinds read."""
    if not scaling:
        return None
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type in (None, "default"):
        return None
    if rope_type not in _ROPE_TYPES:
        raise ModelLoadError(source, f"unsupported rope_scaling type {rope_type!r} (supported: {', '.join(_ROPE_TYPES)})")
    max_positions = int(config.get("max_position_embeddings", 2048))
    original = int(scaling.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
                   or max_positions)
    if rope_type == "llama3":
        return Llama3Scaling(float(scaling["factor"]), float(scaling["low_freq_factor"]),
                             float(scaling["high_freq_factor"]), original)
    if rope_type == "linear":
        return LinearScaling(float(scaling["factor"]))
    if rope_type == "dynamic":
        return DynamicScaling(float(scaling["factor"]), max_positions)
    if rope_type == "yarn":
        attention = scaling.get("attention_factor")
        if attention is None and scaling.get("mscale") and scaling.get("mscale_all_dim"):
            raise ModelLoadError(source, "unsupported: yarn with mscale and mscale_all_dim (DeepSeek's)")
        return YarnScaling(float(scaling["factor"]), original, float(scaling.get("beta_fast") or 32.0),
                           float(scaling.get("beta_slow") or 1.0), None if attention is None else float(attention),
                           bool(scaling.get("truncate", True)))
    return _longrope(scaling, original, max_positions)


def _longrope(scaling: dict[str, Any], original: int, max_positions: int) -> LongRopeScaling:
    # As transformers: the factor is max / original context when the config has both, and the
    # attention factor sqrt(1 + ln(factor) / ln(original)) unless given.
    factor = max_positions / original if original != max_positions else float(scaling.get("factor") or 1.0)
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return LongRopeScaling(tuple(float(f) for f in scaling["short_factor"]), tuple(float(f) for f in scaling["long_factor"]),
                           original, max_positions, float(attention))


def load_hf_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(folder, "no config.json in this folder (expected a Hugging Face model folder)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelLoadError(path, f"unreadable config.json: {error}") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(path, "config.json is not a JSON object")
    return config_from_hf(raw, str(path))


def load_hf_weights(
    folder: Path, config: ModelConfig, dtype: torch.dtype, progress: ProgressFn | None, part: PartFn | None = None
) -> dict[str, torch.Tensor]:
    """The tensors the config needs, read file by file and converted to `dtype` one at a time;
    where `part` names a part of a tensor, only that part's bytes are read."""
    stored = _loom_names(_tensor_files(folder))  # Loom's name -> (file, the name stored there)
    names_by_file = {name: file for name, (file, _) in stored.items()}
    packed = _mxfp4_names(names_by_file)
    shapes = expected_shapes(config)
    check_names(folder, config, {**names_by_file, **packed})
    files: dict[Path, list[str]] = {}
    for name in shapes:
        if name not in packed:
            files.setdefault(names_by_file[name], []).append(name)
    report = LoadProgress(folder, len(shapes), progress)
    tensors: dict[str, torch.Tensor] = {}
    for file, names in files.items():
        with _open_safetensors(file) as handle:
            for name in names:
                tensors[name] = _read_tensor(handle, file, name, stored[name][1], shapes[name], part).to(dtype)
                report.tensor_done(len(tensors))
    for name in [n for n in shapes if n in packed]:
        tensors[name] = _read_mxfp4(names_by_file, name, shapes[name], part).to(dtype)
        report.tensor_done(len(tensors))
    report.finish(tensors)
    return {name: tensors[name] for name in shapes}


def _loom_names(names_by_file: dict[str, Path]) -> dict[str, tuple[Path, str]]:
    """Each stored tensor under the name Loom reads it by: a multimodal checkpoint's text model
    tensors lose their prefix; the rest (other tensors, and a vision tower no name asks for) keep it."""
    out: dict[str, tuple[Path, str]] = {}
    for name, file in names_by_file.items():
        prefixes = _TEXT_MODEL_PREFIXES + _BASE_MODEL_PREFIXES
        loom = next((new + name.removeprefix(old) for old, new in prefixes if name.startswith(old)), name)
        out[loom] = (file, name)
    return out


def _mxfp4_names(names_by_file: dict[str, Path]) -> dict[str, Path]:
    """Tensors stored as MXFP4 `<name>_blocks` and `<name>_scales` (gpt-oss's experts): name -> file."""
    return {name.removesuffix("_blocks"): file for name, file in names_by_file.items()
            if name.endswith("_blocks") and name.removesuffix("_blocks") + "_scales" in names_by_file}


def _read_mxfp4(names_by_file: dict[str, Path], name: str, expected: tuple[int, ...], part: PartFn | None) -> torch.Tensor:
    """An MXFP4 tensor dequantized; a part along its first dim (experts) is read alone."""
    blocks_file, scales_file = names_by_file[name + "_blocks"], names_by_file[name + "_scales"]
    with _open_safetensors(blocks_file) as blocks, _open_safetensors(scales_file) as scales:
        try:
            lazy_blocks, lazy_scales = blocks.get_slice(name + "_blocks"), scales.get_slice(name + "_scales")
            experts = lazy_blocks.get_shape()[0]
            shape = (experts, lazy_blocks.get_shape()[2] * 32, lazy_blocks.get_shape()[1])
            check_shape(blocks_file, name, shape, expected)
            cut = part(name, shape) if part else None
            if cut is not None and cut.dim != 0:
                raise ModelLoadError(blocks_file, f"MXFP4 tensor {name} can only be split by experts")
            rows = slice(cut.start, cut.stop) if cut else slice(None)
            return dequantize_experts(lazy_blocks[rows], lazy_scales[rows])
        except ModelLoadError:
            raise
        except Exception as error:
            raise ModelLoadError(blocks_file, f"cannot read MXFP4 tensor {name}: {error}") from None


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a folder: those its index names, else every *.safetensors."""
    return sorted(set(_tensor_files(folder).values()))


def _tensor_files(folder: Path) -> dict[str, Path]:
    """Maps every tensor name available in the folder to the file holding it."""
    index = folder / INDEX_FILE_NAME
    if index.is_file():
        return _files_from_index(index)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        hint = " (only PyTorch .bin files; convert them to safetensors)" if any(folder.glob("*.bin")) else ""
        raise ModelLoadError(folder, f"no *.safetensors weight files{hint}")
    names: dict[str, Path] = {}
    for file in files:
        with _open_safetensors(file) as handle:
            names.update(dict.fromkeys(handle.keys(), file))
    return names


def _files_from_index(index: Path) -> dict[str, Path]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = {str(name): index.parent / str(file) for name, file in weight_map.items()}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
        raise ModelLoadError(index, f"unreadable safetensors index: {error!r}") from None
    for file in sorted(set(names.values())):
        if not file.is_file():
            raise ModelLoadError(file, "weight file named in the safetensors index is missing")
    return names


def _open_safetensors(file: Path) -> Any:
    try:
        return safe_open(str(file), framework="pt")
    except Exception as error:  # safetensors raises its own SafetensorError and OSError
        raise ModelLoadError(file, f"damaged safetensors file: {error}") from None


def _read_tensor(
    handle: Any, file: Path, name: str, stored_name: str, expected: tuple[int, ...], part: PartFn | None
) -> torch.Tensor:
    try:
        lazy = handle.get_slice(stored_name)  # reads nothing until indexed
        shape = tuple(lazy.get_shape())
        check_shape(file, name, shape, expected)
        cut: Part | None = part(name, shape) if part else None
        return lazy[cut.index()] if cut else lazy[:]
    except ModelLoadError:
        raise
    except Exception as error:
        raise ModelLoadError(file, f"cannot read tensor {name}: {error}") from None
