"""Multi-LoRA in the runner: a step mixing several adapters and the base model gives each sequence
the greedy tokens of transformers + peft with its adapter merged; slots evict least recently used;
bad adapters are refused and change nothing."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator

import pytest
import safetensors.torch
import torch

from loom_proto.config import ShardConfig
from loom_proto.step import NewRequest, RunningRequest, SamplingParams, StepPlan
from loom_shard import kernels
from loom_shard.lora.adapter import AdapterError
from loom_shard.runtime.runner import ModelRunner
from tests.unit.shard.conftest import make_pair, random_tokens
from tests.unit.shard.lora_adapters import ATTENTION, MLP, greedy, merged_model, write_adapter

BLOCK_SIZE = 4
NUM_NEW = 6


@pytest.fixture(scope="module")
def pair():
    return make_pair("llama")


@pytest.fixture(scope="module")
def adapters(pair, tmp_path_factory) -> dict[int, object]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        1: write_adapter(pair.hf, root / "all", seed=1, rank=4),
        2: write_adapter(pair.hf, root / "attn", seed=2, rank=8, targets=ATTENTION, rslora=True),
        3: write_adapter(pair.hf, root / "mlp", seed=3, rank=2, targets=MLP, alpha=4.0),
    }


def _runner(pair, slots: int, max_rank: int = 8, cpu_kernels: str = "auto") -> ModelRunner:
    config = ShardConfig(model_id="tiny", uds_path="", dtype="float32", block_size=BLOCK_SIZE, enable_lora=True,
                         max_loras_per_batch=slots, max_lora_rank=max_rank, cpu_kernels=cpu_kernels)
    runner = ModelRunner(config, model=copy.deepcopy(pair.loom))
    with torch.inference_mode():
        runner.allocate_kv_cache(num_blocks=64, num_host_blocks=0)
    return runner


def _run(runner: ModelRunner, prompts: dict[int, tuple[list[int], int | None]]) -> dict[int, list[int]]:
    """Prefill every prompt in one step, then decode them together; request id -> tokens."""
    news, next_block = [], 0
    for rid, (prompt, lora_id) in prompts.items():
        num_blocks = -(-(len(prompt) + NUM_NEW) // BLOCK_SIZE)
        table = list(range(next_block, next_block + num_blocks))
        next_block += num_blocks
        news.append(NewRequest(rid, prompt, len(prompt), 0, len(prompt), table, SamplingParams(seed=0),
                               lora_id=lora_id))
    generated = {rid: [] for rid in prompts}
    plan = StepPlan(new_requests=news)
    for _ in range(NUM_NEW):
        for out in runner.step(plan).outputs:
            generated[out.request_id].append(out.token_id)
        plan = StepPlan(running_requests=[RunningRequest(rid, 1) for rid in prompts])
    return generated


@pytest.fixture(params=["auto", "off"], ids=["loom-kernels", "torch"])
def cpu_kernels(request: pytest.FixtureRequest) -> Iterator[str]:
    """The CPU applies the factors with Loom's kernels (when a build runs here) or with torch's matmuls."""
    if request.param == "auto" and not kernels.runnable_isas():
        pytest.skip("no build of Loom's CPU kernels runs on this CPU")
    previous = kernels.selection()
    yield request.param
    kernels.select(previous.isa.name if previous.isa else "off")


def test_mixed_batch_matches_merged_adapters(pair, adapters, cpu_kernels: str) -> None:
    runner = _runner(pair, slots=4, cpu_kernels=cpu_kernels)
    assert runner.lora.batch.on_kernels == (cpu_kernels == "auto")
    assert all(linear.batch is runner.lora.batch for _, _, linear in runner.lora.linears)
    for lora_id, folder in adapters.items():
        runner.load_lora(lora_id, str(folder))
    prompts = {10: (random_tokens(9, 1), None), 11: (random_tokens(5, 2), 1), 12: (random_tokens(12, 3), 2),
               13: (random_tokens(7, 4), 3), 14: (random_tokens(6, 5), 1)}
    generated = _run(runner, prompts)
    for rid, (prompt, lora_id) in prompts.items():
        reference = pair.hf if lora_id is None else merged_model(pair.hf, adapters[lora_id])
        assert generated[rid] == greedy(reference, prompt, NUM_NEW), f"request {rid} (adapter {lora_id})"
    # The adapters change the answers (a test of nothing would pass otherwise).
    assert len({tuple(generated[rid]) for rid in (10, 11, 12, 13)}) == 4


def test_more_adapters_than_slots_evict_least_recently_used(pair, adapters) -> None:
    runner = _runner(pair, slots=2)
    for lora_id, folder in adapters.items():
        runner.load_lora(lora_id, str(folder))
    prompt = random_tokens(6, 7)
    first = _run(runner, {1: (prompt, 1), 2: (prompt, 2)})
    assert list(runner.lora.resident) == [1, 2]
    third = _run(runner, {3: (prompt, 3), 4: (prompt, 2)})
    assert set(runner.lora.resident) == {3, 2}  # 1 was the least recently used
    again = _run(runner, {5: (prompt, 1)})
    assert again[5] == first[1] and third[4] == first[2]
    with pytest.raises(ValueError, match="3 adapters in one step"):
        _run(runner, {6: (prompt, 1), 7: (prompt, 2), 8: (prompt, 3)})


def test_bad_adapters_are_refused_and_change_nothing(pair, adapters, tmp_path) -> None:
    runner = _runner(pair, slots=2, max_rank=4)
    with pytest.raises(AdapterError, match="rank 8 is above --max-lora-rank 4"):
        runner.load_lora(1, str(adapters[2]))
    wide = copy.deepcopy(pair.hf)  # one projection of another shape than the base model's
    wide.model.layers[0].mlp.gate_proj = torch.nn.Linear(64, 128, bias=False)
    write_adapter(wide, tmp_path / "shape", seed=4, targets=["gate_proj"])
    with pytest.raises(AdapterError, match="do not fit the base model"):
        runner.load_lora(1, str(tmp_path / "shape"))
    write_adapter(pair.hf, tmp_path / "head", seed=5, targets=["lm_head"])
    with pytest.raises(AdapterError, match="unsupported target modules"):
        runner.load_lora(1, str(tmp_path / "head"))
    damaged = write_adapter(pair.hf, tmp_path / "damaged", seed=6)
    data = (damaged / "adapter_model.safetensors").read_bytes()
    (damaged / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(AdapterError, match="cannot be read"):
        runner.load_lora(1, str(damaged))
    (damaged / "adapter_config.json").write_text("{")
    with pytest.raises(AdapterError, match="not valid JSON"):
        runner.load_lora(1, str(damaged))
    with pytest.raises(AdapterError, match="does not exist"):
        runner.load_lora(1, str(tmp_path / "missing"))
    poisoned = write_adapter(pair.hf, tmp_path / "nan", seed=7)  # one NaN would garble every answer
    tensors = safetensors.torch.load_file(poisoned / "adapter_model.safetensors")
    first = sorted(name for name in tensors if "lora_B" in name)[0]
    tensors[first][0, 0] = float("nan")
    safetensors.torch.save_file(tensors, poisoned / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match="NaN or infinity"):
        runner.load_lora(1, str(poisoned))
    assert runner.lora.host == {} and json.loads((adapters[1] / "adapter_config.json").read_text())["r"] == 4
    with pytest.raises(ValueError, match="not loaded"):
        _run(runner, {1: (random_tokens(4, 1), 1)})


def test_an_adapter_is_identified_by_the_bytes_it_was_read_from(pair, adapters, tmp_path) -> None:
    import hashlib

    runner = _runner(pair, slots=2, max_rank=8)
    folder = adapters[1]
    files = [(folder / name).read_bytes() for name in ("adapter_config.json", "adapter_model.safetensors")]
    assert runner.read_lora(str(folder)).digest == hashlib.sha256(b"".join(files)).hexdigest()
    other = write_adapter(pair.hf, tmp_path / "other", seed=9)  # same config, other weights
    assert runner.read_lora(str(other)).digest != runner.read_lora(str(folder)).digest
