"""The Triton paged-attention kernel against a float64 reference, on CUDA."""

from __future__ import annotations

import pytest
import torch

from loom_shard.attention.backend import BackendKind, pack_step_tables, paged_metadata, select_backend
from loom_shard.attention.metadata import AttentionSpec
from tests.gpu.kernel_cases import make_case, reference, relative_error

CASES = [
    ([1] * 7, [0, 1, 15, 16, 17, 100, 700]),  # decodes only, block boundaries
    ([300], [0]),  # one prefill longer than a key tile
    ([37, 5, 1, 1, 1], [0, 60, 3, 250, 31]),  # chunked prefills then decodes
]


def _run(case) -> torch.Tensor:
    backend = select_backend(torch.device("cuda"))
    assert backend.kind is BackendKind.TRITON
    packed, shape = pack_step_tables(case.spans, case.block_size)
    meta = paged_metadata(packed.cuda(), shape, case.block_size, backend.kernel)
    return meta.paged.kernel(case.q, case.kv_layer, meta.paged, AttentionSpec.plain(case.q.shape[-1]))


@pytest.mark.parametrize(("query_lens", "cached"), CASES)
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_kernel_matches_float64_reference(query_lens, cached, dtype, tolerance, head_dim) -> None:
    for seed in range(2):  # fresh inputs each time
        case = make_case(seed, "cuda", dtype, query_lens, cached, heads=9, kv_heads=3, head_dim=head_dim)
        assert relative_error(_run(case), reference(case)) < tolerance


def test_metadata_slots_follow_block_tables() -> None:
    case = make_case(3, "cuda", torch.float32, [5, 1], [14, 33], block_size=16)
    packed, shape = pack_step_tables(case.spans, case.block_size)
    meta = paged_metadata(packed.cuda(), shape, case.block_size, kernel=None)
    expected = [s.block_table[p // 16] * 16 + p % 16 for s in case.spans
                for p in range(s.num_cached, s.num_cached + s.num_compute)]
    assert meta.slot_mapping.tolist() == expected
    assert meta.positions.tolist() == [14, 15, 16, 17, 18, 33]
