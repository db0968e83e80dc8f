"""Where a shard runs (its device, its share of the model), and the one line it fails with where it
cannot, before any weight is read."""

from __future__ import annotations

import pytest
import torch

from loom_shard.runtime.model_setup import ShardSetupError, resolve_device


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_cuda_without_a_gpu_is_one_line_before_any_model_loads() -> None:
    with pytest.raises(ShardSetupError, match="--device cuda: rank 0 needs GPU 0"):
        resolve_device("cuda", 0)
    assert resolve_device("auto", 0) == resolve_device("cpu", 3) == torch.device("cpu")


def test_ranks_that_cannot_split_the_model_are_one_line_before_any_weight_loads() -> None:
    from loom_proto.config import ShardConfig
    from loom_shard.runtime.model_setup import load_model

    config = ShardConfig(model_id="", rank=0, world_size=2, uds_path="/tmp/unused")  # 3 kv heads
    with pytest.raises(ShardSetupError, match="--num-shard 2: world size 2 must divide num_kv_heads 3"):
        load_model(config, torch.float32, torch.device("cpu"))
