"""How a model's embeddings are made, from its folder's sentence-transformers configuration
(`modules.json`: a Pooling module's `config.json` and an optional Normalize module), or the
defaults of `--task embed` (last token, normalized). Plain JSON: the router reads it without torch."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

from loom_proto.step import Pooling

POOLING_MODULE = "sentence_transformers.models.Pooling"
NORMALIZE_MODULE = "sentence_transformers.models.Normalize"


class PoolingConfigError(ValueError):
    """The folder's sentence-transformers config asks for something Loom does not do."""


@dataclass(slots=True, frozen=True)
class EmbeddingSpec:
    pooling: Pooling
    normalize: bool


@functools.lru_cache(maxsize=8)
def embedding_spec(model_id: str, task: str) -> EmbeddingSpec | None:
    """The model's embedding setup; None when it is not an embedding model (no sentence-transformers
    config and --task generate)."""
    folder = Path(model_id)
    modules_file = folder / "modules.json"
    if folder.is_dir() and modules_file.exists():
        return _from_modules(folder, json.loads(modules_file.read_text()))
    return EmbeddingSpec(Pooling.LAST, normalize=True) if task == "embed" else None


def _from_modules(folder: Path, modules: list[dict]) -> EmbeddingSpec:
    types = {module.get("type", "").split(".")[-1]: module for module in modules}
    normalize = "Normalize" in types
    pooling = types.get("Pooling")
    if pooling is None:
        return EmbeddingSpec(Pooling.LAST, normalize)
    config = json.loads((folder / pooling.get("path", "") / "config.json").read_text())
    mode = config.get("pooling_mode")  # sentence-transformers >= 6; before: one flag per mode
    if mode == "lasttoken" or config.get("pooling_mode_lasttoken"):
        return EmbeddingSpec(Pooling.LAST, normalize)
    if mode == "mean" or config.get("pooling_mode_mean_tokens"):
        return EmbeddingSpec(Pooling.MEAN, normalize)
    modes = [mode] if isinstance(mode, str) else sorted(
        key for key, on in config.items() if key.startswith("pooling_mode") and on)
    raise PoolingConfigError(f"sentence-transformers pooling {modes} is not supported: last-token or mean only")


def finish_vector(vector: list[float], normalize: bool, dimensions: int | None) -> list[float]:
    """The pooled vector cut to `dimensions` (Matryoshka, as OpenAI's `dimensions`), then normalized
    when the model normalizes."""
    if dimensions is not None:
        vector = vector[:dimensions]
    if normalize:
        norm = math.sqrt(math.fsum(x * x for x in vector))
        if norm > 0:
            vector = [x / norm for x in vector]
    return vector
