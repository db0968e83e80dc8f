"""The adapters a shard holds: every loaded adapter's factors in host memory, and `num_slots` of
them resident in device slots (the LoraLinear buffers), the least recently used evicted first.

A step names its adapters; `assign` makes them resident (copying host -> device for the missing
ones) and returns their slots. The router never sends more distinct adapters in one step than
there are slots (--max-loras-per-batch); a plan that does is refused before anything changes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from loom_shard import kernels
from loom_shard.lora.adapter import AdapterError, read_adapter
from loom_shard.lora.layout import PROJECTIONS, Projection, local_sizes, module_shapes, projection_factors
from loom_shard.lora.linear import LoraBatch, LoraLinear, unwrap


@dataclass(slots=True, frozen=True)
class HostAdapter:
    """An adapter in host memory: its rank, per LoraLinear in order (A, B per part) or None, its digest."""

    rank: int
    factors: list[tuple[torch.Tensor, list[torch.Tensor]] | None]
    digest: str  # sha256 of its files (LoraAdapter.digest)


def on_kernels(param: torch.Tensor) -> bool:
    """Whether Loom's CPU kernels apply the factors (loom::lora_shrink / lora_expand_)."""
    return param.device.type == "cpu" and kernels.available()


def factor_dtype(param: torch.Tensor) -> torch.dtype:
    """The dtype the factors are kept and applied in: the model's on CUDA and on Loom's CPU kernels
    (which read bfloat16 factors at half float32's bytes); float32 on the CPU's torch path, where
    torch's bfloat16 bmm at these shapes ran 1.2x (one thread) to 9x (two, on a busy machine) slower
    than float32's (bench/BENCHMARKS.md, LoRA)."""
    if param.device.type == "cuda" or on_kernels(param):
        return param.dtype
    return torch.float32


class LoraSlots:
    """Installs LoraLinear around every targetable projection of `model` and manages their slots."""

    def __init__(self, model: nn.Module, num_slots: int, max_rank: int, rank: int = 0, world_size: int = 1) -> None:
        assert num_slots > 0 and max_rank > 0
        self.num_slots, self.max_rank = num_slots, max_rank
        self.rank, self.world_size = rank, world_size
        self.shapes = module_shapes(model)
        self.batch = LoraBatch(slot_ranks=torch.zeros(num_slots, dtype=torch.long))
        self.linears: list[tuple[int, Projection, LoraLinear]] = []  # (layer, Projection, module)
        self._install(model)
        self.host: dict[int, HostAdapter] = {}  # lora id -> its factors
        self.resident: OrderedDict[int, int] = OrderedDict()  # lora id -> slot, least recently used first

    def _install(self, model: nn.Module) -> None:
        param = next(model.parameters())
        self.dtype = factor_dtype(param)
        self.batch.on_kernels = on_kernels(param)
        for index, layer in enumerate(model.layers):
            for proj in PROJECTIONS:
                if proj.parts[0] not in self.shapes.shapes:
                    continue
                owner = getattr(layer, proj.owner)
                base = unwrap(getattr(owner, proj.name))
                in_local, outs = local_sizes(proj, self.shapes, self.world_size)
                width = len(proj.parts) * self.max_rank
                a = torch.zeros(self.num_slots, width, in_local, dtype=self.dtype, device=param.device)
                b = [torch.zeros(self.num_slots, self.max_rank, out, dtype=self.dtype, device=param.device)
                     for out in outs]
                linear = LoraLinear(base, a, b, self.batch, proj.row_parallel and self.world_size > 1)
                setattr(owner, proj.name, linear)
                self.linears.append((index, proj, linear))

    def load(self, lora_id: int, path: str | Path) -> None:
        """Read and check the adapter, keep it in host memory. Raises AdapterError (nothing changed)."""
        self.add(lora_id, self.read(path))

    def add(self, lora_id: int, adapter: HostAdapter) -> None:
        """Keep an adapter that `read` returned under lora_id."""
        if lora_id in self.host:
            raise AdapterError(f"adapter id {lora_id} is already loaded")
        self.host[lora_id] = adapter

    def read(self, path: str | Path) -> HostAdapter:
        """The adapter's factors per LoraLinear, this rank's share, in host memory. Touches no state
        (it may run beside a step). Raises AdapterError."""
        adapter = read_adapter(path, self.shapes, self.max_rank)
        pin = self.linears and self.linears[0][2].lora_a.device.type == "cuda"
        factors: list[tuple[torch.Tensor, list[torch.Tensor]] | None] = []
        for layer, proj, _ in self.linears:
            pair = projection_factors(adapter, layer, proj, self.shapes, self.max_rank, self.rank, self.world_size)
            if pair is not None and pin:  # copied to the device slot without a staging copy
                pair = (pair[0].pin_memory(), [b.pin_memory() for b in pair[1]])
            factors.append(pair)
        return HostAdapter(adapter.rank, factors, adapter.digest)

    def unload(self, lora_id: int) -> bool:
        """Forget the adapter (its slot becomes free); False when it was not loaded."""
        self.resident.pop(lora_id, None)
        return self.host.pop(lora_id, None) is not None

    def check(self, lora_ids: set[int]) -> None:
        """Raise ValueError unless a step of these adapters can run."""
        missing = sorted(i for i in lora_ids if i not in self.host)
        if missing:
            raise ValueError(f"adapters {missing} are not loaded on this shard")
        if len(lora_ids) > self.num_slots:
            raise ValueError(f"{len(lora_ids)} adapters in one step; this shard has {self.num_slots} slots")

    def assign(self, lora_ids: set[int]) -> dict[int, int]:
        """Make these adapters resident (evicting the least recently used others); their slots."""
        self.check(lora_ids)
        for lora_id in lora_ids:
            if lora_id in self.resident:
                self.resident.move_to_end(lora_id)
        for lora_id in sorted(lora_ids - set(self.resident)):
            self._upload(lora_id, self._free_slot(lora_ids))
        return {lora_id: self.resident[lora_id] for lora_id in lora_ids}

    def _free_slot(self, needed: set[int]) -> int:
        used = set(self.resident.values())
        free = [slot for slot in range(self.num_slots) if slot not in used]
        if free:
            return free[0]
        victim = next(lora_id for lora_id in self.resident if lora_id not in needed)  # least recently used
        return self.resident.pop(victim)

    @torch.no_grad()
    def _upload(self, lora_id: int, slot: int) -> None:
        adapter = self.host[lora_id]
        for (_, _, linear), pair in zip(self.linears, adapter.factors):
            if pair is None:
                linear.lora_a[slot].zero_()
                for b in linear.lora_b:
                    b[slot].zero_()
            else:
                linear.lora_a[slot].copy_(pair[0], non_blocking=True)
                for b, host in zip(linear.lora_b, pair[1]):
                    b[slot].copy_(host, non_blocking=True)
        self.batch.slot_ranks[slot] = adapter.rank  # the kernels read no padding row beyond it
        self.resident[lora_id] = slot


__all__ = ["AdapterError", "HostAdapter", "LoraSlots"]
