"""`--quantize auto`: a GGUF's quantized projections stay quantized in QuantLinear modules.

The loader hands over raw blocks by Hugging Face name; here they are fused as the model fuses its
projections (q/k/v, gate/up) and swapped in for the model's nn.Linear before the rest loads; a
layer's experts (named one by one, `DecoderModel.expert_names`) become `QuantExperts`. A group whose
parts are all quantized but in different kinds runs as a SplitLinear (a QuantLinear per run of one
kind); a group with a part not quantized is dequantized back into the state dict, so any GGUF
still loads.
"""

from __future__ import annotations

import logging
from collections import Counter
from itertools import groupby

import torch
from torch import nn

from loom_shard.layers.moe import MoE, QuantExperts
from loom_shard.layers.quant_linear import QuantLinear, QuantSource
from loom_shard.layers.split_linear import SplitLinear
from loom_shard.models.decoder import DecoderModel
from loom_shard.models.weights import FUSED

log = logging.getLogger(__name__)

_PART_OF = {f".{part}": f".{fused}" for fused, parts in FUSED.items() for part in parts if part.endswith("weight")}


def install_quant_linears(
    model: DecoderModel, quantized: dict[str, QuantSource], weights: dict[str, torch.Tensor], dtype: torch.dtype
) -> int:
    """Swap in a QuantLinear for each (fused) quantized weight, QuantExperts for each layer's
    quantized experts; returns how many linears. Groups that cannot run quantized go back into
    `weights` dequantized to `dtype`."""
    swapped = _install_quant_experts(model, quantized, weights, dtype)
    groups: dict[str, list[tuple[str, QuantSource]]] = {}
    for name, source in quantized.items():
        suffix = next((s for s in _PART_OF if name.endswith(s)), None)
        target = name.removesuffix(suffix) + _PART_OF[suffix] if suffix else name
        groups.setdefault(target.removeprefix("model."), []).append((name, source))
    for target, parts in groups.items():
        expected = _expected_parts(target)
        names = [n for n, _ in parts]
        if set(names) != set(expected):
            log.info("%s: parts not all quantized; dequantized to %s", target, dtype)
            weights.update({n: s.dequantize().to(dtype) for n, s in parts})
            continue
        runs = _runs_of_one_kind([dict(parts)[n] for n in expected])
        swapped += _swap(model, target.removesuffix(".weight"), runs, dtype)
    return swapped


def _runs_of_one_kind(sources: list[QuantSource]) -> list[QuantSource]:
    """Consecutive parts of one kind fused into one source each (one source where all are alike)."""
    return [QuantSource.cat(list(run)) for _, run in groupby(sources, key=lambda source: source.kind)]


def _install_quant_experts(model: DecoderModel, quantized: dict[str, QuantSource], weights: dict[str, torch.Tensor],
                           dtype: torch.dtype) -> int:
    """Pop every expert's quantized projections: a layer whose experts are all quantized, each one's
    gate and up alike (they run fused), runs them as QuantExperts (Q4_K_M's Q6_K down projections
    beside Q4_K gate and up too); the others get them back dequantized. Returns the linears made."""
    made = 0
    for index, layer in enumerate(model.layers):
        if not isinstance(layer.mlp, MoE) or model.expert_names(index, 0) is None:
            continue
        names = [model.expert_names(index, e) for e in range(layer.mlp.experts.num_experts)]
        sources = [[quantized.pop(n, None) for n in triple] for triple in names]
        found = [s for triple in sources for s in triple if s is not None]
        if len(found) < 3 * len(names) or any(gate.kind is not up.kind for gate, up, _ in sources):
            for triple, parts in zip(names, sources):
                weights.update({n: s.dequantize().to(dtype) for n, s in zip(triple, parts) if s is not None})
            continue
        up = [QuantSource.cat([gate, up]) for gate, up, _ in sources]
        experts = layer.mlp.experts
        layer.mlp.experts = QuantExperts([QuantLinear(s, None, dtype) for s in up],
                                         [QuantLinear(down, None, dtype) for _, _, down in sources], experts.activation)
        made += 2 * len(up)
    return made


def _expected_parts(target: str) -> list[str]:
    """The Hugging Face names whose rows make up `target` (one name when it is not fused)."""
    for fused, parts in FUSED.items():
        if target.endswith(fused):
            prefix = "model." + target.removesuffix(fused)
            return [prefix + p for p in parts]
    return [target if target == "lm_head.weight" else "model." + target]


def _swap(model: nn.Module, path: str, runs: list[QuantSource], dtype: torch.dtype) -> int:
    """The nn.Linear at `path` replaced by a QuantLinear (one run) or a SplitLinear of them; returns
    how many QuantLinears."""
    parent_path, _, child = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    linear = getattr(parent, child)
    out_features = sum(run.out_features for run in runs)
    if not isinstance(linear, nn.Linear) or (linear.out_features, linear.in_features) != (
            out_features, runs[0].in_features):
        raise ValueError(f"{path}: a quantized weight [{out_features}, {runs[0].in_features}] does not fit")
    bias = None if linear.bias is None else linear.bias.detach().to(dtype)
    if len(runs) == 1:
        setattr(parent, child, QuantLinear(runs[0], bias, dtype))
    else:
        setattr(parent, child, SplitLinear([QuantLinear(run, None, dtype) for run in runs], bias))
    return len(runs)


def quantized_summary(model: nn.Module) -> str:
    """"Q4_1 x120, Q8_0 x1 (loom kernels)", "Q4_0 x120 as Q4_1, Q8_0 x1 (loom kernels)" for a
    converted format, or "none": what model info reports."""
    mods = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if not mods:
        return "none"
    groups = Counter((m.file_kind, m.kind.name) for m in mods)
    counts = ", ".join(f"{held} x{n}" + (f" as {runs}" if held != runs else "") for (held, runs), n in sorted(groups.items()))
    return f"{counts} ({'loom kernels' if mods[0].uses_kernels else 'torch int4pack'})"
