"""Embedding requests: their final hidden states (after the model's last norm, as a transformers
base model returns them) pooled into one vector, once the whole prompt is computed. Mean pooling
adds each prefill chunk's rows to the request's running sum, so chunked prefill gives the same vector."""

from __future__ import annotations

import torch

from loom_proto.step import Pooling
from loom_shard.runtime.requests import Scheduled


def pool(norm: torch.nn.Module, hidden: torch.Tensor, scheduled: list[Scheduled]) -> dict[int, list[float]]:
    """hidden [num_tokens, hidden] of the step (before the norm) -> {index in scheduled: vector} for
    every embedding request whose prompt this step completes."""
    vectors: dict[int, list[float]] = {}
    offset = 0
    for index, s in enumerate(scheduled):
        state, rows = s.state, slice(offset, offset + s.num_compute)
        offset += s.num_compute
        if state.pooling is Pooling.NONE:
            continue
        if state.pooling is Pooling.MEAN:
            chunk = norm(hidden[rows]).float().sum(dim=0)  # [hidden]
            state.pooled_sum = chunk if state.pooled_sum is None else state.pooled_sum + chunk
            if s.reaches_end:
                vectors[index] = (state.pooled_sum / len(state.token_ids)).tolist()
        elif s.reaches_end:
            vectors[index] = norm(hidden[rows][-1:]).float()[0].tolist()
    return vectors
