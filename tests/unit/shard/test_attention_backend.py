"""The attention-backend interface on CPU: backend choice, packed step tables and the
device-side positions/slots a paged kernel (and a CUDA graph) derives from them."""

from __future__ import annotations

import torch

from loom_shard.attention.backend import BackendKind, pack_step_tables, paged_metadata, select_backend
from loom_shard.attention.metadata import SeqSpan


def test_cpu_uses_the_paged_kernel_when_it_builds(monkeypatch) -> None:  # noqa: ANN001
    from loom_shard import kernels

    expected = BackendKind.CPU_PAGED if kernels.available() else BackendKind.TORCH
    assert select_backend(torch.device("cpu")).kind is expected
    monkeypatch.setattr(kernels, "available", lambda: False)  # no compiler: the torch paths
    assert select_backend(torch.device("cpu"), torch.bfloat16).kind is BackendKind.TORCH


def test_packed_tables_layout_and_shape() -> None:
    spans = [SeqSpan(5, 3, [7, 2, 9]), SeqSpan(9, 1, [4, 1, 8])]
    packed, shape = pack_step_tables(spans, block_size=4)
    # query_starts | num_cached | block tables cut to the blocks reached (2 and 3), padded with 0
    assert packed.tolist() == [0, 3, 4] + [5, 9] + [7, 2, 0] + [4, 1, 8]
    assert (shape.num_seqs, shape.max_blocks, shape.num_tokens, shape.max_position) == (2, 3, 4, 9)


def test_paged_metadata_positions_and_slots_follow_the_block_tables() -> None:
    spans = [SeqSpan(5, 3, [7, 2, 9]), SeqSpan(0, 2, [6]), SeqSpan(9, 1, [4, 1, 8])]
    packed, shape = pack_step_tables(spans, block_size=4, max_blocks=5)
    meta = paged_metadata(packed, shape, block_size=4, kernel=None)
    assert meta.positions.tolist() == [5, 6, 7, 0, 1, 9]
    expected = [s.block_table[p // 4] * 4 + p % 4 for s in spans for p in range(s.num_cached, s.num_cached + s.num_compute)]
    assert meta.slot_mapping.tolist() == expected
    assert meta.paged.block_tables.shape == (3, 5)
    assert meta.paged.query_starts.tolist() == [0, 3, 5, 6]
