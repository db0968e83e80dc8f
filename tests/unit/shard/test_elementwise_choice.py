"""Which kernels do the elementwise work on CUDA: the Triton kernels only once they passed their
self-check on that device and dtype; else torch's ops, said in one log line (no GPU needed: the
Triton module is replaced by a stand-in whose check passes or fails)."""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Iterator

import pytest
import torch

import loom_shard.layers
from loom_shard.layers import elementwise

CUDA = torch.device("cuda", 0)


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    module = types.ModuleType("loom_shard.layers.triton_elementwise")
    module.checked = []  # type: ignore[attr-defined]
    module.self_check = lambda device, dtype: module.checked.append((device, dtype))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(loom_shard.layers, "triton_elementwise", module, raising=False)
    elementwise._triton_kernels.cache_clear()
    yield module
    elementwise._triton_kernels.cache_clear()


def test_kernels_that_pass_their_check_are_chosen_once_per_device_and_dtype(stand_in: types.ModuleType) -> None:
    assert elementwise._triton_kernels(CUDA, torch.bfloat16) is stand_in
    assert elementwise._triton_kernels(CUDA, torch.bfloat16) is stand_in
    assert elementwise._triton_kernels(CUDA, torch.float32) is stand_in
    assert stand_in.checked == [(CUDA, torch.bfloat16), (CUDA, torch.float32)]


def test_kernels_that_fail_their_check_leave_torchs_ops_with_one_log_line(
        stand_in: types.ModuleType, caplog: pytest.LogCaptureFixture) -> None:
    def fails(device: torch.device, dtype: torch.dtype) -> None:
        raise RuntimeError("PassManager::run failed")  # what a Triton compile error looks like

    stand_in.self_check = fails  # type: ignore[attr-defined]
    with caplog.at_level(logging.WARNING, logger=elementwise.__name__):
        assert elementwise._triton_kernels(CUDA, torch.bfloat16) is None
        assert elementwise._triton_kernels(CUDA, torch.bfloat16) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "PassManager::run failed" in warnings[0] and "torch's ops" in warnings[0]


def test_no_triton_means_torchs_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "loom_shard.layers.triton_elementwise", None)  # import fails
    monkeypatch.delattr(loom_shard.layers, "triton_elementwise", raising=False)
    elementwise._triton_kernels.cache_clear()
    try:
        assert elementwise._triton_kernels(CUDA, torch.bfloat16) is None
    finally:
        elementwise._triton_kernels.cache_clear()


def test_cpu_tensors_never_ask_for_triton(stand_in: types.ModuleType) -> None:
    elementwise.kernels_for(torch.zeros(2, 4))
    assert stand_in.checked == []
