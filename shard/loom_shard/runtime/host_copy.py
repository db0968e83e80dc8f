"""A device tensor on its way to the host, queued behind the work that computes it.

On CUDA the copy goes into pinned memory without waiting, and an event marks where it ends, so
the host can queue the next step's work before it reads the result; elsewhere the tensor is
already on the host.
"""

from __future__ import annotations

import torch


class HostCopy:
    def __init__(self, tensor: torch.Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        if tensor.is_cuda:
            self._host = tensor.to("cpu", non_blocking=True)  # pinned: the copy overlaps the host
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tensor

    def ready(self) -> bool:
        """Has the copy landed (never blocks)?"""
        return self._event is None or self._event.query()

    def wait(self) -> None:
        """Block until the copy has landed (the GIL is released meanwhile)."""
        if self._event is not None:
            self._event.synchronize()

    def read(self) -> torch.Tensor:
        self.wait()
        return self._host
