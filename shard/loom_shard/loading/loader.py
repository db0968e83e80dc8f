"""The shard's door to model files: resolves a model id (a GGUF file, a Hugging Face
folder, or "" for the embedded default) and returns its ModelConfig and weights with
Hugging Face names. Every failure is a ModelLoadError with a one-line message."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from loom_proto.embedded import EMBEDDED_FILE_NAME, EmbeddedModelMissing, embedded_model_path, is_default_model_id
from loom_shard.layers.quant_linear import QuantSource
from loom_shard.loading.common import ModelLoadError, PartFn, ProgressFn, expected_shapes, stderr_progress
from loom_shard.loading.gguf_file import gguf_config, load_gguf_weights, open_gguf
from loom_shard.loading.hf_folder import config_from_hf, load_hf_config, load_hf_weights, safetensors_files
from loom_shard.model_config import ModelConfig

__all__ = [
    "ModelLoadError",
    "config_from_hf",
    "expected_shapes",
    "load_model_config",
    "load_model_weights",
    "resolve_model_path",
    "weights_hash",
]

# Files up to this size are hashed whole (sha256 runs at ~1 GB/s); larger ones are sampled.
_FULL_HASH_MAX_BYTES = 256 * 2**20
_SAMPLE_BYTES = 2**20
_NUM_SAMPLES = 64


def resolve_model_path(model_id: str) -> Path:
    """The GGUF file or Hugging Face folder a model id names; "" means the embedded default."""
    if is_default_model_id(model_id):
        try:
            return embedded_model_path()
        except EmbeddedModelMissing as error:
            raise ModelLoadError(f"<embedded default {EMBEDDED_FILE_NAME}>", str(error)) from None
    path = Path(model_id).expanduser()
    if not path.exists():
        raise ModelLoadError(
            path, "no such file or folder (give a local GGUF file or Hugging Face folder; nothing is downloaded)"
        )
    if path.is_dir() or path.is_file():  # a file's GGUF magic is checked when it is opened
        return path.resolve()
    raise ModelLoadError(path, "neither a regular file nor a folder")


def load_model_config(model_id: str) -> ModelConfig:
    """The model's architecture from metadata only (no tensor data is read)."""
    path = resolve_model_path(model_id)
    if path.is_dir():
        return load_hf_config(path)
    return gguf_config(path, open_gguf(path))


def load_model_weights(
    model_id: str, dtype: torch.dtype, progress: ProgressFn | None = stderr_progress, part: PartFn | None = None,
    quantized: dict[str, QuantSource] | None = None,
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The config and every tensor the model needs, in `dtype`, with Hugging Face names.

    Tied models have no "lm_head.weight". Progress lines go to `progress` (stderr by default).
    part(name, shape) names the part of a tensor to read (a tensor-parallel rank's slice): only
    that part's bytes are read and converted, so host memory holds only the rank's share.
    quantized: GGUF projection weights in a format QuantLinear runs go there, kept quantized.
    """
    path = resolve_model_path(model_id)
    if path.is_dir():
        config = load_hf_config(path)
        return config, load_hf_weights(path, config, dtype, progress, part)
    reader = open_gguf(path)
    config = gguf_config(path, reader)
    return config, load_gguf_weights(path, reader, config, dtype, progress, part, quantized)


def weights_hash(model_id: str) -> str:
    """A stable sha256 fingerprint of the weight files: names, sizes and bytes.

    Files up to 256 MiB are hashed whole; larger ones by their first MiB and 64
    evenly spaced 1 MiB samples, so that fingerprinting a 15 GB model stays cheap.
    """
    path = resolve_model_path(model_id)
    files = [path] if path.is_file() else _folder_files(path)
    digest = hashlib.sha256()
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}\0{size}\0".encode())
        try:
            _hash_file(digest, file, size)
        except OSError as error:
            raise ModelLoadError(file, f"unreadable file: {error.strerror or error}") from None
    return digest.hexdigest()


def _folder_files(folder: Path) -> list[Path]:
    config = folder / "config.json"
    if not config.is_file():
        raise ModelLoadError(folder, "no config.json in this folder (expected a Hugging Face model folder)")
    return [config, *safetensors_files(folder)]


def _hash_file(digest: hashlib._Hash, file: Path, size: int) -> None:
    with file.open("rb") as handle:
        if size <= _FULL_HASH_MAX_BYTES:
            while chunk := handle.read(8 * 2**20):
                digest.update(chunk)
            return
        stride = (size - _SAMPLE_BYTES) // _NUM_SAMPLES
        for offset in [0, *(stride * (i + 1) for i in range(_NUM_SAMPLES))]:
            handle.seek(offset)
            digest.update(handle.read(_SAMPLE_BYTES))
