"""Every family Loom serves against transformers on the same random weights, in float32: logits
within 1e-4 over mixed paged batches (prefill chunks after cached tokens, decodes), and 32 greedy
tokens equal through the runner, on prompts longer than every sliding window; a multimodal Gemma 3
checkpoint serves its text model."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from loom_proto.step import NewRequest, RunningRequest, SamplingParams, StepPlan
from loom_shard.loading.loader import load_model_weights
from loom_shard.models import build_model
from tests.unit.shard import families
from tests.unit.shard.conftest import SeqChunk, hf_logits, make_cache, make_pair, random_tokens, run_chunks, tiny_runner

BLOCK_SIZE = 4


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-4) -> None:
    # Relative to the logits' scale, so near-zero entries do not demand absolute exactness.
    scale = expected.abs().max().item()
    err = (actual - expected).abs().max().item()
    assert err <= rtol * scale, f"max error {err:.3g} exceeds {rtol} x scale {scale:.3g}"


@pytest.mark.parametrize("kind", families.KINDS)
def test_mixed_paged_batch_matches_transformers(kind: str) -> None:
    pair = make_pair(kind)
    cache = make_cache(pair.loom, BLOCK_SIZE, num_blocks=40)
    ids = list(range(40))
    random.Random(1).shuffle(ids)  # block tables in no particular order
    # Every sequence is longer than the windows (8) and Phi-3's trained context (32).
    a, b, c = random_tokens(50, 1), random_tokens(37, 2), random_tokens(40, 3)
    ta, tb, tc = ids[:13], ids[13:23], ids[23:33]
    # Step 1: a prefills a first chunk, b its whole prompt, c all but its last token.
    first = run_chunks(pair.loom, cache, [SeqChunk(a, 0, 20, ta), SeqChunk(b, 0, 36, tb), SeqChunk(c, 0, 39, tc)])
    # Step 2: a's chunk starts after cached tokens (past every window); b and c decode.
    second = run_chunks(pair.loom, cache, [SeqChunk(a, 20, 30, ta), SeqChunk(b, 36, 1, tb), SeqChunk(c, 39, 1, tc)])
    ref_a, ref_b, ref_c = hf_logits(pair.hf, a), hf_logits(pair.hf, b), hf_logits(pair.hf, c)
    assert_close(first[0], ref_a[:20])
    assert_close(second[0], ref_a[20:50])
    assert_close(first[1], ref_b[:36])
    assert_close(second[1], ref_b[36:37])
    assert_close(first[2], ref_c[:39])
    assert_close(second[2], ref_c[39:40])


def greedy_reference(hf, tokens: list[int], num_new: int) -> list[int]:  # noqa: ANN001
    """transformers' greedy tokens, each from a full forward over the sequence so far (its
    generate() is no reference here: for Gemma 3 with prompts longer than the window, its first
    token already differs from the full forward's)."""
    tokens = list(tokens)
    for _ in range(num_new):
        tokens.append(int(hf_logits(hf, tokens)[-1].argmax()))
    return tokens[-num_new:]


def runner_greedy(pair, prompt: list[int], num_new: int, chunk: int) -> list[int]:  # noqa: ANN001
    """Greedy tokens through the ModelRunner: the prompt prefilled in chunks, then decodes."""
    runner = tiny_runner(pair, BLOCK_SIZE, num_blocks=128)
    groups = runner.kv_groups.num_groups  # one block per KV group for each logical block
    blocks = list(range(127, 127 - -(-(len(prompt) + num_new) // BLOCK_SIZE) * groups, -1))  # descending
    new = NewRequest(1, prompt, len(prompt), 0, min(chunk, len(prompt)), blocks, SamplingParams(seed=0))
    out = runner.step(StepPlan(new_requests=[new])).outputs[0]
    computed = min(chunk, len(prompt))
    while computed < len(prompt):
        n = min(chunk, len(prompt) - computed)
        out = runner.step(StepPlan(running_requests=[RunningRequest(1, n)])).outputs[0]
        computed += n
    tokens = [out.token_id]
    while len(tokens) < num_new:
        tokens.append(runner.step(StepPlan(running_requests=[RunningRequest(1, 1)])).outputs[0].token_id)
    return tokens


# One model per family and rope scaling (the logits test above covers every tiny model).
GREEDY_KINDS = ["llama3", "llama_yarn", "mistral", "qwen3_window", "gemma2", "gemma3", "phi3", "mixtral", "qwen3_moe",
                "gpt_oss"]


@pytest.mark.parametrize("kind", GREEDY_KINDS)
def test_greedy_32_tokens_match_transformers(kind: str) -> None:
    pair = make_pair(kind)
    prompt = random_tokens(41, 7)
    assert runner_greedy(pair, prompt, 32, chunk=17) == greedy_reference(pair.hf, prompt, 32)


def _save_multimodal_gemma3(folder: Path, layout: str) -> transformers.PreTrainedModel:
    """A tiny Gemma3ForConditionalGeneration (the text model of `families`' gemma3, a one-layer
    vision tower), its text_config listing only what differs from the defaults, as the released
    files do; tensors named as transformers 4 saves them (language_model.model.*) or as 5 does
    (model.language_model.*)."""
    vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=families.hf_config("gemma3").to_dict(), vision_config=vision.to_dict(),
                                       mm_tokens_per_image=4, architectures=["Gemma3ForConditionalGeneration"])
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    families.randomize(hf)
    hf.save_pretrained(folder, safe_serialization=True)
    raw = json.loads((folder / "config.json").read_text())
    defaults = transformers.Gemma3TextConfig().to_dict()
    raw["text_config"] = {k: v for k, v in raw["text_config"].items() if k == "model_type" or defaults.get(k) != v}
    assert "rope_local_base_freq" not in raw["text_config"]  # read from Loom's defaults
    (folder / "config.json").write_text(json.dumps(raw))
    (file,) = folder.glob("*.safetensors")
    names = list(load_file(file))
    assert any(n.startswith("language_model.model.") for n in names)
    if layout == "model.language_model":
        renamed = {("lm_head." + n.removeprefix("language_model.lm_head.")) if n.startswith("language_model.lm_head.")
                   else "model." + n.replace("language_model.model.", "language_model."): t
                   for n, t in load_file(file).items()}
        save_file(renamed, file, metadata={"format": "pt"})
    return hf


@pytest.mark.parametrize("layout", ["language_model.model", "model.language_model"])
def test_multimodal_gemma3_serves_its_text_model(tmp_path: Path, layout: str) -> None:
    hf = _save_multimodal_gemma3(tmp_path, layout)
    config, weights = load_model_weights(str(tmp_path), torch.float32, progress=None)
    assert config.architecture == "Gemma3ForCausalLM" and config.num_layers == 6
    loom = build_model(config)
    loom.load_weights(weights)
    loom.eval()
    prompt = random_tokens(41, 5)
    cache = make_cache(loom, BLOCK_SIZE, num_blocks=20)
    (logits,) = run_chunks(loom, cache, [SeqChunk(prompt, 0, len(prompt), list(range(11)))])
    with torch.no_grad():
        assert_close(logits, hf(torch.tensor([prompt])).logits[0].float())
