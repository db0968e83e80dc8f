"""Reading a PEFT LoRA folder (`adapter_config.json` + `adapter_model.safetensors`) into per-module
low-rank factors, checked against the base model's shapes. Anything Loom cannot apply exactly is
refused with a message naming it (`AdapterError`), before any state changes."""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load

# PEFT's target names that map onto Loom's projections (fused q/k/v and gate/up included).
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


class AdapterError(ValueError):
    """The adapter cannot be served: str() says why, in one line."""


@dataclass(slots=True, frozen=True)
class ModuleShapes:
    """The base model's (whole, not per-rank) projection shapes: module -> (in_features, out_features)."""

    num_layers: int
    shapes: dict[str, tuple[int, int]]


@dataclass(slots=True)
class LoraAdapter:
    """One adapter's factors: (layer, module) -> (A [rank, in], B [out, rank] with the scaling folded in)."""

    rank: int
    factors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    digest: str = ""  # sha256 of its files

    @property
    def modules(self) -> set[str]:
        return {module for _, module in self.factors}


def read_adapter(path: str | Path, base: ModuleShapes, max_rank: int) -> LoraAdapter:
    """The adapter in `path`, checked against `base` and `max_rank`. Raises AdapterError."""
    folder = Path(path)
    if not folder.is_dir():
        raise AdapterError(f"adapter folder {str(folder)!r} does not exist")
    config_bytes = _read_bytes(folder / "adapter_config.json")
    config = _parse_config(config_bytes)
    rank, alpha = int(config.get("r", 8)), float(config.get("lora_alpha", 8))
    if rank > max_rank:
        raise AdapterError(f"adapter rank {rank} is above --max-lora-rank {max_rank}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights_bytes = _read_bytes(folder / "adapter_model.safetensors")
    factors = _read_factors(weights_bytes, base, rank)
    # What a KV snapshot records: the sha256 of the very bytes parsed above (config, then weights).
    digest = hashlib.sha256(config_bytes)
    digest.update(weights_bytes)
    return LoraAdapter(rank, {key: (a.float(), b.float() * scaling) for key, (a, b) in factors.items()},
                       digest.hexdigest())


def _read_bytes(file: Path) -> bytes:
    try:
        return file.read_bytes()
    except FileNotFoundError:
        raise AdapterError(f"{file.parent} has no {file.name}") from None
    except OSError as error:
        raise AdapterError(f"{file.name} cannot be read: {error}") from None


def _parse_config(raw: bytes) -> dict:
    try:
        config = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise AdapterError(f"adapter_config.json is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise AdapterError("adapter_config.json must hold an object")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"unsupported adapter type {config.get('peft_type')!r}: only LORA")
    unsupported = {key: config[key] for key in ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern",
                                                "fan_in_fan_out") if config.get(key)}
    if config.get("bias", "none") != "none":
        unsupported["bias"] = config["bias"]
    if unsupported:
        raise AdapterError(f"unsupported adapter options {unsupported}")
    targets = config.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    bad = [t for t in targets if t.split(".")[-1] not in SUPPORTED_MODULES]
    if bad:
        raise AdapterError(f"unsupported target modules {bad}; supported: {', '.join(SUPPORTED_MODULES)}")
    return config


def _read_factors(raw: bytes, base: ModuleShapes, rank: int) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    try:
        tensors = load(raw)
    except (SafetensorError, ValueError) as error:
        raise AdapterError(f"adapter_model.safetensors cannot be read (damaged?): {error}") from None
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR.search(name)
        if match is None:
            raise AdapterError(f"unsupported adapter tensor {name!r}")
        layer, module, half = int(match.group(1)), match.group(2), match.group(3)
        if module not in SUPPORTED_MODULES:
            raise AdapterError(f"unsupported target module {module!r} in {name!r}")
        if module not in base.shapes:  # e.g. MLP projections of a mixture-of-experts model
            raise AdapterError(f"unsupported target module {module!r} for this model (in {name!r})")
        if layer >= base.num_layers:
            raise AdapterError(f"{name!r}: layer {layer} outside the base model's {base.num_layers}")
        halves.setdefault((layer, module), {})[half] = tensor
    factors = {}
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"layer {layer} {module}: lora_A and lora_B must both be present")
        in_features, out_features = base.shapes[module]
        a, b = pair["A"], pair["B"]
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise AdapterError(f"layer {layer} {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit "
                               f"the base model (expected ({rank}, {in_features}) / ({out_features}, {rank}))")
        if not (a.is_floating_point() and b.is_floating_point()):
            raise AdapterError(f"layer {layer} {module}: LoRA weights must be floating point, "
                               f"not {a.dtype} / {b.dtype}")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(f"layer {layer} {module}: the weights hold NaN or infinity (a damaged adapter?)")
        factors[(layer, module)] = (a, b)
    if not factors:
        raise AdapterError("the adapter holds no LoRA weights")
    return factors
