"""Pinned host memory that a step's inputs pass through on their way to the GPU.

A copy to the device overlaps the host only from pinned (page-locked) memory. Pinning a fresh
tensor for each input of each step costs tens of microseconds a call (the caching host
allocator's bookkeeping), on the host path that a GPU waits on between steps; one buffer pinned
once and refilled every step costs a memcpy. It is refilled only after the device has read the
last step's inputs from it (an event recorded behind those copies).
"""

from __future__ import annotations

import torch

_ALIGN = 64  # each staged tensor starts on its own cache line (and any dtype's alignment)


class PinnedStaging:
    """`stage` copies host tensors into the buffer and returns pinned views of them; `done_reading`
    (after the device copies from those views are enqueued) lets the next `stage` reuse it."""

    def __init__(self, max_bytes: list[int]) -> None:
        """max_bytes: the most bytes of each tensor `stage` takes, in its order."""
        self.buffer = torch.empty(sum(_aligned(size) for size in max_bytes), dtype=torch.uint8, pin_memory=True)
        self._read = torch.cuda.Event()  # synchronize() on an event never recorded returns at once

    def stage(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Pinned copies of `tensors` (contiguous host tensors), in one buffer; raises ValueError
        when they do not fit."""
        self._read.synchronize()  # the last step's copies have left the buffer
        views, offset = [], 0
        for tensor in tensors:
            size = tensor.numel() * tensor.element_size()
            if offset + size > self.buffer.numel():
                raise ValueError(f"{sum(t.nbytes for t in tensors)} bytes to stage in a {self.buffer.numel()}-byte buffer")
            view = self.buffer[offset : offset + size].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor)
            views.append(view)
            offset += _aligned(size)
        return views

    def done_reading(self) -> None:
        """Mark, on the current stream, where the device has read everything staged so far."""
        self._read.record()


def _aligned(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN
