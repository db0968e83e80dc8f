"""What every weight loader shares: the error type, progress reports, the list of Hugging Face
tensor names (and shapes) a config needs, and the part of a tensor a tensor-parallel rank reads."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from loom_shard.model_config import ModelConfig
from loom_shard.models import family

ProgressFn = Callable[[str], None]


class ModelLoadError(Exception):
    """A model could not be loaded; str() is one line naming the path and the reason."""

    def __init__(self, path: Path | str, reason: str) -> None:
        self.path = str(path)
        self.reason = " ".join(str(reason).split())  # one line, whatever the cause said
        super().__init__(f"cannot load model {self.path}: {self.reason}")


def stderr_progress(message: str) -> None:
    """The default progress sink: one line on stderr, which the launcher shows."""
    print(f"[loom_shard.loader] {message}", file=sys.stderr, flush=True)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The Hugging Face state-dict names and shapes the model needs, in load order (its family's)."""
    return family(config.architecture).checkpoint_shapes(config)


def check_names(path: Path, config: ModelConfig, available: Iterable[str]) -> None:
    """Raises ModelLoadError naming the first missing tensors, before any is read."""
    present = set(available)
    missing = [name for name in expected_shapes(config) if name not in present]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ModelLoadError(path, f"missing tensor(s) {shown}")


def check_shape(path: Path, name: str, shape: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if tuple(shape) != tuple(expected):
        raise ModelLoadError(path, f"tensor {name} has shape {list(shape)}, the config needs {list(expected)}")


class LoadProgress:
    """Reports a long load about every quarter of its tensors, then the total time."""

    def __init__(self, path: Path, num_tensors: int, progress: ProgressFn | None) -> None:
        self._progress = progress
        self._num_tensors = num_tensors
        self._next_quarter = 1
        self._start = time.perf_counter()
        self._say(f"loading {num_tensors} tensors from {path}")

    def tensor_done(self, num_done: int) -> None:
        while self._next_quarter < 4 and num_done * 4 >= self._next_quarter * self._num_tensors:
            self._say(f"  {25 * self._next_quarter}% ({num_done}/{self._num_tensors} tensors)")
            self._next_quarter += 1

    def finish(self, tensors: dict[str, torch.Tensor]) -> None:
        num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        seconds = time.perf_counter() - self._start
        self._say(f"loaded {len(tensors)} tensors ({num_bytes / 2**20:.0f} MiB) in {seconds:.1f} s")

    def _say(self, message: str) -> None:
        if self._progress is not None:
            self._progress(message)


@dataclass(slots=True, frozen=True)
class Part:
    """Indices [start, stop) along `dim` of a tensor: the part of it a tensor-parallel rank reads."""

    dim: int
    start: int
    stop: int

    def index(self) -> tuple[slice, ...]:
        return (slice(None),) * self.dim + (slice(self.start, self.stop),)

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor[self.index()].contiguous()

    def shape_of(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of this part of a tensor of `shape`."""
        return shape[: self.dim] + (self.stop - self.start,) + shape[self.dim + 1 :]


# (Hugging Face name, its whole shape) -> the part to read, None for all of it; see
# loader.load_model_weights
PartFn = Callable[[str, tuple[int, ...]], Part | None]
