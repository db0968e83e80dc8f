"""gpt-oss's MXFP4 experts (`*_blocks` / `*_scales` in its safetensors, as released) load
dequantized into the model transformers runs on the same values."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from loom_shard.loading.loader import load_model_weights
from loom_shard.loading.mxfp4 import FP4_VALUES
from loom_shard.models import build_model
from tests.unit.shard import families
from tests.unit.shard.conftest import hf_logits, random_tokens
from tests.unit.shard.test_families import assert_close
from tests.unit.shard.test_gguf_families import _logits

LUT = torch.tensor(FP4_VALUES)


def pack(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A checkpoint tensor [experts, cols, rows] as MXFP4 blocks [experts, rows, cols / 32, 16] and
    scales [experts, rows, cols / 32], and the values they hold (the same layout as `weight`)."""
    rows_first = weight.transpose(1, 2)  # [experts, rows, cols]
    groups = rows_first.reshape(*rows_first.shape[:2], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    codes = (scaled.unsqueeze(-1) - LUT).abs().argmin(-1)  # nearest FP4 value
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    held = (LUT[codes] * torch.exp2(exponent).unsqueeze(-1)).reshape(rows_first.shape).transpose(1, 2)
    return blocks, (exponent + 127).to(torch.uint8), held.contiguous()


def test_mxfp4_experts_load_as_transformers_runs_them(tmp_path: Path) -> None:
    hf = families.hf_model("gpt_oss")
    state = {name: tensor.detach().clone() for name, tensor in hf.state_dict().items()}
    with torch.no_grad():
        for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            blocks, scales, held = pack(state.pop(name))
            state[name + "_blocks"], state[name + "_scales"] = blocks, scales
            hf.get_parameter(name).copy_(held)  # transformers runs the dequantized values
    hf.config.quantization_config = {"quant_method": "mxfp4"}
    hf.config.save_pretrained(tmp_path)
    save_file(state, tmp_path / "model.safetensors")
    config, weights = load_model_weights(str(tmp_path), torch.float32, progress=None)
    model = build_model(config)
    model.load_weights(weights)
    tokens = random_tokens(41, 10)
    assert_close(_logits(model.eval(), tokens), hf_logits(hf, tokens))
