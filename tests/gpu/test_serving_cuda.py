"""The real launcher serving the embedded model on CUDA (the e2e suite itself runs on CUDA
through `-p tests.gpu.e2e_on_cuda`; this test proves the shard is on the GPU)."""

from __future__ import annotations

import httpx
import pytest

from loom_proto.embedded import EmbeddedModelMissing, embedded_model_path
from tests.e2e.conftest import spawn_launcher, wait_healthy


@pytest.mark.slow
def test_launcher_serves_on_cuda_with_graphs(tmp_path_factory) -> None:
    try:
        embedded_model_path()
    except EmbeddedModelMissing as error:
        pytest.skip(str(error))
    folder = tmp_path_factory.mktemp("l", numbered=True)
    launcher = spawn_launcher(folder, "--device", "cuda", "--dtype", "float32")
    try:
        wait_healthy(launcher)
        info = httpx.get(f"{launcher.base_url}/info", timeout=10).json()
        assert info["model_device_type"].startswith("cuda")
        body = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 16, "details": True}}
        solo = httpx.post(f"{launcher.base_url}/generate", json=body, timeout=120).json()
        assert len(solo["details"]["tokens"]) in range(1, 17)
        again = httpx.post(f"{launcher.base_url}/generate", json=body, timeout=120).json()
        assert again["generated_text"] == solo["generated_text"]  # float32 greedy is deterministic
    finally:
        launcher.stop()
