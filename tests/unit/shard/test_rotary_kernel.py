"""The rotary CPU kernel (`kernels/csrc/rotary.cpp`) against the torch path, and its dispatch."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from loom_shard import kernels
from loom_shard.layers.rotary import GatheredRope, KernelRope, RotaryEmbedding, apply_rotary

pytestmark = pytest.mark.usefixtures("kernel_isa")  # once per build this CPU runs

HEAD_DIM, NUM_QK_HEADS, NUM_V_HEADS = 64, 12, 3


def _qkv(num_tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """A fused q/k/v projection's view: the q/k heads are not contiguous across tokens."""
    torch.manual_seed(0)
    return torch.randn(num_tokens, NUM_QK_HEADS + NUM_V_HEADS, HEAD_DIM).to(dtype)


def _torch_path(rope: RotaryEmbedding, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    rope.use_kernel = False
    gathered = rope.lookup(positions, int(positions.max()), x.dtype)
    rope.use_kernel = True
    assert isinstance(gathered, GatheredRope)
    return gathered.apply(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_torch_path(dtype: torch.dtype) -> None:
    rope = RotaryEmbedding(HEAD_DIM, 10000.0, None)
    qk = _qkv(9, dtype)[:, :NUM_QK_HEADS]
    positions = torch.tensor([0, 1, 2, 7, 100, 2047, 4095, 5000, 3])  # 5000: past the initial table
    kernel_rope = rope.lookup(positions, 5000, dtype)
    assert isinstance(kernel_rope, KernelRope)
    out = kernel_rope.apply(qk)
    expected = _torch_path(rope, qk.float(), positions)  # float32 reference
    assert out.dtype == dtype and out.shape == qk.shape and out.is_contiguous()
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


def test_position_zero_is_the_identity_and_halves_rotate_as_rotate_half() -> None:
    rope = RotaryEmbedding(4, 1.0, None, initial_len=8)  # inv_freq [1, 1]: angle = position
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])
    at_zero = rope.lookup(torch.tensor([0]), 0, torch.float32).apply(x)
    assert torch.equal(at_zero, x)
    c, s = torch.cos(torch.tensor(1.0)), torch.sin(torch.tensor(1.0))
    at_one = rope.lookup(torch.tensor([1]), 1, torch.float32).apply(x)
    manual = torch.stack([1 * c - 3 * s, 2 * c - 4 * s, 3 * c + 1 * s, 4 * c + 2 * s])
    torch.testing.assert_close(at_one[0, 0], manual)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_bit_identical_at_any_batch(dtype: torch.dtype) -> None:
    rope = RotaryEmbedding(HEAD_DIM, 10000.0, None)
    qk = _qkv(40, dtype)[:, :NUM_QK_HEADS]
    positions = torch.randint(0, 4096, (40,))
    step = rope.lookup(positions, 4095, dtype)
    alone = torch.cat([KernelRope(positions[i : i + 1], step.cos, step.sin).apply(qk[i : i + 1]) for i in range(40)])
    for rows in (1, 5, 40):
        assert torch.equal(KernelRope(positions[:rows], step.cos, step.sin).apply(qk[:rows]), alone[:rows])


def test_without_kernels_the_torch_path_is_unchanged() -> None:
    rope = RotaryEmbedding(HEAD_DIM, 10000.0, None)
    qk = _qkv(3, torch.bfloat16)[:, :NUM_QK_HEADS]
    positions = torch.tensor([4, 5, 6])
    with mock.patch.object(kernels, "available", return_value=False):
        gathered = rope.lookup(positions, 6, torch.bfloat16)
    assert isinstance(gathered, GatheredRope)
    assert torch.equal(gathered.apply(qk), apply_rotary(qk, gathered.cos, gathered.signed_sin))
    rope.use_kernel = False
    assert isinstance(rope.lookup(positions, 6, torch.bfloat16), GatheredRope)


def test_a_position_outside_the_table_is_refused() -> None:
    rope = RotaryEmbedding(HEAD_DIM, 10000.0, None, initial_len=16)
    step = rope.lookup(torch.tensor([3]), 3, torch.float32)
    with pytest.raises(RuntimeError, match="outside the cos/sin table"):
        KernelRope(torch.tensor([16]), step.cos, step.sin).apply(_qkv(1, torch.float32)[:, :NUM_QK_HEADS])
