"""The embedded SmolLM2 through Loom's loader, model and runner against transformers on
the same GGUF, float32, greedy: the generated tokens must agree one for one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from loom_proto.config import ShardConfig
from loom_proto.step import NewRequest, RunningRequest, SamplingParams, StepPlan
from loom_shard.loading.loader import resolve_model_path
from loom_shard.runtime.runner import ModelRunner

pytestmark = pytest.mark.slow

EOS_ID = 2  # <|im_end|>, as the GGUF says (transformers' conversion reports id 1)
NUM_NEW_TOKENS = 48
BLOCK_SIZE = 16
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return resolve_model_path("")


@pytest.fixture(scope="module")
def prompt_ids(gguf_path: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in PROMPTS
    ]
    # transformers' GGUF tokenizer adds a BOS the GGUF does not want (MODEL-NOTES pitfalls).
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


def transformers_model(gguf_path: Path) -> PreTrainedModel:
    """What from_pretrained(gguf_file=...) builds; that entry point needs accelerate, absent here."""
    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied to the embedding
    model.tie_weights()
    return model


@torch.inference_mode()
def transformers_greedy(model: PreTrainedModel, prompt: list[int]) -> list[int]:
    output = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=NUM_NEW_TOKENS,
        do_sample=False,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
    )
    return _until_eos(output[0, len(prompt) :].tolist())


def _until_eos(token_ids: list[int]) -> list[int]:
    return token_ids[: token_ids.index(EOS_ID) + 1] if EOS_ID in token_ids else token_ids


def loom_greedy(runner: ModelRunner, prompts: list[list[int]]) -> list[list[int]]:
    """All prompts in one batch: one mixed prefill step, then decode steps, as the router drives it."""
    blocks_per_seq = -(-(max(map(len, prompts)) + NUM_NEW_TOKENS) // BLOCK_SIZE)
    runner.allocate_kv_cache(num_blocks=blocks_per_seq * len(prompts), num_host_blocks=1)
    new_requests = [
        NewRequest(
            request_id=i,
            token_ids=list(prompt),
            num_prompt_tokens=len(prompt),
            num_cached=0,
            num_compute=len(prompt),
            block_table=list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
            sampling=SamplingParams(seed=0),
        )
        for i, prompt in enumerate(prompts)
    ]
    generated: list[list[int]] = [[] for _ in prompts]
    plan = StepPlan(new_requests=new_requests)
    while plan.num_requests:
        for output in runner.step(plan).outputs:
            generated[output.request_id].append(output.token_id)
        active = [i for i, tokens in enumerate(generated) if tokens[-1] != EOS_ID and len(tokens) < NUM_NEW_TOKENS]
        plan = StepPlan(running_requests=[RunningRequest(request_id=i, num_compute=1) for i in active])
    return generated


def test_loom_greedy_matches_transformers_float32(gguf_path: Path, prompt_ids: list[list[int]]) -> None:
    assert len(prompt_ids[0]) == 37  # llama.cpp's count for this chat prompt (MODEL-NOTES)
    reference_model = transformers_model(gguf_path)
    expected = [transformers_greedy(reference_model, prompt) for prompt in prompt_ids]
    del reference_model

    runner = ModelRunner(ShardConfig(model_id="", uds_path="unused.sock", dtype="float32", quantize="none"))
    actual = loom_greedy(runner, prompt_ids)

    # The comparison covers real generations: one runs to the token limit, none ends at once.
    assert max(map(len, expected)) == NUM_NEW_TOKENS and min(map(len, expected)) > 1
    for prompt, want, got in zip(PROMPTS, expected, actual):
        assert got == want, f"{prompt!r}: first difference at token {_first_difference(got, want)}"


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
