"""A tiny random Llama saved with a SentencePiece tokenizer.json (▁ pieces, <0xXX> byte fallback,
BOS), served by the real launcher: streamed pieces keep their leading spaces, and the official
`text_generation` client's stream joins to `generated_text`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import Launcher, StartLauncher
from text_generation import Client
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "router"))
from sentencepiece_tokenizer import write_sentencepiece_tokenizer  # noqa: E402

from loom_router.tokenizer import load_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow
NUM_NON_PIECES = 3 + 256  # <unk>, <s>, </s>, then the byte tokens


@pytest.fixture
def sentencepiece_llama(tmp_path: Path, start_launcher: StartLauncher) -> Launcher:
    folder = write_sentencepiece_tokenizer(tmp_path / "sp-llama")
    vocab_size = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"].__len__()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    LlamaForCausalLM(config).eval().save_pretrained(folder, safe_serialization=True)
    return start_launcher("--model-id", str(folder), "--max-total-tokens", "128")


def test_sentencepiece_pieces_stream_with_their_leading_spaces(sentencepiece_llama: Launcher, tmp_path: Path) -> None:
    tokenizer = load_tokenizer(str(tmp_path / "sp-llama"))
    client = Client(sentencepiece_llama.base_url, timeout=120)
    num_spaced = 0
    for prompt in ("the quick brown", "the lazy dog"):
        full = client.generate(prompt, max_new_tokens=48)
        streamed = list(client.generate_stream(prompt, max_new_tokens=48))
        assert "".join(r.token.text for r in streamed) == full.generated_text == streamed[-1].generated_text
        assert [r.token.text for r in streamed] == [t.text for t in full.details.tokens]
        for token in full.details.tokens:
            piece = tokenizer.token_text(token.id) or ""
            if piece.startswith("▁") and not token.special:
                # One by one, SentencePiece's decoder strips this space; the stream keeps it
                # (after any bytes it completes or releases).
                assert token.text.endswith(" " + piece[1:]), (piece, token.text)
                num_spaced += 1
    assert num_spaced >= 3, "the random model sampled too few word pieces to test"
