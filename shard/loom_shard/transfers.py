"""Values between the host and the device, without waiting for the work queued there.

`to_device` sends host values to the device behind the queued work (a blocking copy would wait
for the whole stream: the step the device is still computing); from pageable memory the driver
stages the values before the call returns, so the host values may go at once. `HostCopy` brings
a device tensor back: on CUDA into pinned memory without waiting, with an event that marks where
the copy ends, so the host can queue the next step's work before it reads the result; elsewhere
the tensor is already on the host.
"""

from __future__ import annotations

import array

import torch


def host_ints(values: list[int] | array.array, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A host tensor of ints (int32 or int64), converted through `array` (faster than torch.tensor's)."""
    code = "i" if dtype == torch.int32 else "q"
    if not isinstance(values, array.array) or values.typecode != code:
        values = array.array(code, values)
    return torch.frombuffer(values, dtype=dtype) if values else torch.empty(0, dtype=dtype)


def to_device(values: list | array.array, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """values as a `dtype` tensor on `device`: ints through `host_ints`, floats through torch.tensor."""
    host = torch.tensor(values, dtype=dtype) if dtype.is_floating_point else host_ints(values, dtype)
    return host.to(device, non_blocking=True)


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
