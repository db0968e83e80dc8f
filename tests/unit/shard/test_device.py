"""Which device a shard runs on, and the one line it fails with where that device is missing."""

from __future__ import annotations

import pytest
import torch

from loom_shard.runtime.model_setup import ShardSetupError, resolve_device


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_cuda_without_a_gpu_is_one_line_before_any_model_loads() -> None:
    with pytest.raises(ShardSetupError, match="--device cuda: rank 0 needs GPU 0"):
        resolve_device("cuda", 0)
    assert resolve_device("auto", 0) == resolve_device("cpu", 3) == torch.device("cpu")
