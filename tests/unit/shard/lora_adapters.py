"""Random PEFT LoRA adapters for tiny transformers models, written as PEFT folders, and their
merged references (transformers + peft with the adapter merged into the weights)."""

from __future__ import annotations

import copy
from pathlib import Path

import peft
import torch
import transformers

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def write_adapter(hf: transformers.PreTrainedModel, folder: Path, seed: int, rank: int = 4,
                  targets: list[str] | None = None, alpha: float = 8.0, rslora: bool = False) -> Path:
    """A PEFT LoRA of `hf` with random A and B (B non-zero: PEFT starts it at zero), saved in folder."""
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets or ATTENTION + MLP,
                             lora_dropout=0.0, use_rslora=rslora)
    model = peft.get_peft_model(copy.deepcopy(hf), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    model.save_pretrained(str(folder))
    return folder


def merged_model(hf: transformers.PreTrainedModel, folder: Path) -> transformers.PreTrainedModel:
    """transformers + peft: the adapter in `folder` merged into a copy of `hf`."""
    model = peft.PeftModel.from_pretrained(copy.deepcopy(hf), str(folder))
    return model.merge_and_unload().eval()


@torch.no_grad()
def greedy(hf: transformers.PreTrainedModel, prompt: list[int], num_new: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(num_new):
        tokens.append(int(hf(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]
