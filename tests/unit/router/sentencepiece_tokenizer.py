"""A tiny Llama-style SentencePiece tokenizer (▁ for spaces, <0xXX> byte fallback, BOS added),
saved as a Hugging Face folder: tokenizer.json + tokenizer_config.json, as Llama 2 ships them."""

from __future__ import annotations

import json
from pathlib import Path

from loom_router.tokenizer import _sentencepiece_bpe

WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world")
_NORMAL, _UNKNOWN, _CONTROL, _BYTE = 1, 2, 3, 6  # GGUF token types


def write_sentencepiece_tokenizer(folder: Path) -> Path:
    """Writes the folder and returns it. Pieces: every substring of "▁word" (longer ones merge first)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [_UNKNOWN, _CONTROL, _CONTROL] + [_BYTE] * 256
    pieces = sorted({w[i:j] for word in WORDS for w in ["▁" + word] for i in range(len(w))
                     for j in range(i + 1, len(w) + 1)}, key=lambda p: (len(p), p))
    tokens += pieces
    types += [_NORMAL] * len(pieces)
    scores = [0.0] * 259 + [float(len(p)) for p in pieces]
    backend = _sentencepiece_bpe(tokens, scores, types, add_space_prefix=True)
    backend.add_special_tokens(["<s>", "</s>"])
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
              "add_eos_token": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder
