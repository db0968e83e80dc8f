"""Incremental detokenization and stop sequences, on the embedded tokenizer and a tiny HF one."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from loom_router.frontend.text import IncrementalDetokenizer, StopMatcher, token_spans, token_texts
from loom_router.tokenizer import Tokenizer, load_tokenizer
from loom_router.types import StopText

TEXTS = [
    "The capital of France is Paris.\n\nIt has 2,148,271 inhabitants (2020).",
    "emoji 😀👍🏽 🇫🇷 family 👨‍👩‍👧 and CJK 日本語のテキスト 中文 한국어",
    "def f(x):\n    return x**2  # comment\n",
    "  spaces   everywhere  \t\n end",
]


@pytest.fixture(scope="module")
def smollm() -> Tokenizer:
    return load_tokenizer("")


@pytest.fixture(scope="module")
def metaspace(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A SentencePiece-style BPE (▁ for spaces, leading space stripped on decode), as an HF folder."""
    backend = Backend(models.BPE(unk_token="<unk>"))
    backend.normalizer = normalizers.NFKC()
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    backend.train_from_iterator(["the quick brown fox jumps over the lazy dog. Hello world!"] * 10, trainer)
    folder = tmp_path_factory.mktemp("metaspace")
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return load_tokenizer(str(folder))


def _stream(tok: Tokenizer, prompt_ids: list[int], ids: list[int], skip_special: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip_special)
    return [detok.add(i) for i in ids] + [detok.flush()]


def test_incremental_output_equals_full_decode(smollm: Tokenizer):
    prompt_ids = smollm.encode("<|im_start|>assistant\n")
    for text in TEXTS:
        ids = smollm.encode(text)
        chunks = _stream(smollm, prompt_ids, ids)
        assert "".join(chunks) == smollm.decode(ids) == text
        assert not any("\ufffd" in c for c in chunks)


def test_multibyte_characters_split_across_tokens_come_out_whole(smollm: Tokenizer):
    ids = smollm.encode("😀日本")
    pieces = [smollm.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces)  # the precondition: bytes of one character span tokens
    chunks = _stream(smollm, [], ids)
    assert "".join(chunks) == "😀日本"
    assert all(c in ("", "😀", "日", "本", "日本", "😀日", "😀日本") for c in chunks)


def test_held_back_bytes_are_flushed_at_the_end(smollm: Tokenizer):
    ids = smollm.encode("😀")
    detok = IncrementalDetokenizer(smollm, [])
    assert [detok.add(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.flush().startswith("\ufffd")  # an unfinished character is not lost silently


def test_special_tokens_skipped_or_kept(smollm: Tokenizer):
    ids = smollm.encode("Hi<|im_end|>")
    assert "".join(_stream(smollm, [], ids)) == "Hi"
    assert "".join(_stream(smollm, [], ids, skip_special=False)) == "Hi<|im_end|>"


def test_leading_space_survives_with_sentencepiece_style_decoder(metaspace: Tokenizer):
    prompt = metaspace.encode("the quick", add_special_tokens=False)
    text = "the quick brown fox jumps"
    full = metaspace.encode(text, add_special_tokens=False)
    assert full[: len(prompt)] == prompt
    generated = full[len(prompt) :]
    chunks = _stream(metaspace, prompt, generated)
    assert "".join(chunks) == " brown fox jumps"  # decoding tokens one by one would lose the spaces
    assert metaspace.decode(generated) == "brown fox jumps"


def test_long_sequences_stay_exact(smollm: Tokenizer):
    text = " ".join(f"word{i} 😀" for i in range(400))
    ids = smollm.encode(text)
    assert "".join(_stream(smollm, [], ids)) == text


def test_stop_sequence_across_token_boundaries_is_cut(smollm: Tokenizer):
    ids = smollm.encode("The answer is 42.\nUser: next question")
    detok, stop = IncrementalDetokenizer(smollm, []), StopMatcher(["\nUser:"])
    emitted, stopped_at = "", None
    for n, token in enumerate(ids):
        text, stopped = stop.feed(detok.add(token))
        emitted += text
        if stopped:
            stopped_at = n
            break
    assert emitted == "The answer is 42."
    assert stopped_at is not None and stopped_at < len(ids) - 1


def test_stop_matcher_holds_back_then_releases_partial_prefix():
    stop = StopMatcher(["STOP"])
    assert stop.feed("abc ST") == ("abc ", False)
    assert stop.feed("O") == ("", False)
    assert stop.feed("P? no, STA") == ("", True)  # "STOP" completed at the start of this chunk


def test_stop_matcher_releases_when_prefix_breaks():
    stop = StopMatcher(["STOP"])
    assert stop.feed("abc STO") == ("abc ", False)
    assert stop.feed("RY") == ("STORY", False)
    assert stop.feed(" ST") == (" ", False)
    assert stop.flush() == "ST"  # released at the end: it never became a stop sequence


def test_stop_matcher_earliest_of_several_and_overlaps():
    stop = StopMatcher(["world", "lo w", "xyz"])
    assert stop.feed("hello") == ("hel", False)
    assert stop.feed(" world") == ("", True)  # "lo w" starts before "world": cut there
    assert StopMatcher(["aab"]).feed("aaab") == ("a", True)  # overlapping partial prefixes


def test_stop_matcher_keeping_the_stop_ends_with_the_first_to_complete():
    stop = StopMatcher(["world", "lo w", "xyz"], StopText.KEEP)
    assert stop.feed("hello") == ("hel", False)
    assert stop.feed(" world and more") == ("lo w", True)  # "lo w" ends first: the text ends with it
    held = StopMatcher(["STOP"], StopText.KEEP)
    assert held.feed("abc ST") == ("abc ", False)
    assert held.feed("OP and after") == ("STOP", True)


def test_stop_matcher_to_the_token_end_keeps_the_token_that_completed_the_stop():
    stop = StopMatcher(["d Sta"], StopText.KEEP_TOKEN)  # TGI's: whole tokens
    assert stop.feed(" United") == (" Unite", False)
    assert stop.feed(" States") == ("d States", True)
    assert stop.feed(" of") == ("", True)


def test_stop_matcher_after_stop_and_without_stops():
    stop = StopMatcher(["x"])
    assert stop.feed("x tail") == ("", True)
    assert stop.feed("more") == ("", True)
    assert StopMatcher([]).feed("anything") == ("anything", False)
    assert StopMatcher([""]).feed("anything") == ("anything", False)


# ---- prompt token texts, /tokenize spans, raw bytes (one rule for every API) -----------------


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    from sentencepiece_tokenizer import write_sentencepiece_tokenizer

    return load_tokenizer(str(write_sentencepiece_tokenizer(tmp_path_factory.mktemp("sp"))))


def test_token_texts_join_to_the_decode_without_replacement_chars(smollm: Tokenizer, sentencepiece: Tokenizer):
    for tok in (smollm, sentencepiece):
        ids = tok.encode("the quick brown fox 日本 😀 jumps")
        assert any("\ufffd" in tok.decode([i]) for i in ids)  # precondition: split characters
        texts = token_texts(tok, ids)
        assert len(texts) == len(ids)
        assert "".join(texts) == tok.decode(ids)
        assert not any("\ufffd" in t for t in texts)


def test_sentencepiece_stream_keeps_leading_spaces(sentencepiece: Tokenizer):
    prompt = sentencepiece.encode("the quick")
    generated = sentencepiece.encode(" brown fox 日本 jumps", add_special_tokens=False)
    chunks = _stream(sentencepiece, prompt, generated)
    assert "".join(chunks) == "  brown fox 日本 jumps"  # "▁" + "▁brown": the space prefix, then " brown"
    assert chunks[1] == " brown" and chunks[2] == " fox" and chunks[-2] == " jumps"
    assert sentencepiece.decode([generated[1]]) == "brown"  # one by one, the space was lost


def test_token_spans_cover_the_input_once_in_order(smollm: Tokenizer, sentencepiece: Tokenizer):
    text = "the quick 日本 😀 café  jumps"
    for tok in (smollm, sentencepiece):
        spans = token_spans(tok, text)
        ids, _ = tok.encode_with_offsets(text)
        assert [s["id"] for s in spans] == ids
        assert "".join(s["text"] for s in spans) == text.lstrip(" ")
        for before, after in zip(spans, spans[1:]):
            assert before["stop"] <= after["start"]  # no overlaps: a split character goes to its last token
        assert all(s["text"] == text[s["start"]:s["stop"]] for s in spans)
    assert token_spans(smollm, text, truncate=2) == token_spans(smollm, text)[-2:]


def test_token_spans_are_linear_in_the_input(smollm: Tokenizer):
    # 50,000 words took minutes when spans came from decoding growing prefixes: now one pass.
    text = " ".join(f"word{i} é" for i in range(25_000))
    spans = token_spans(smollm, text)
    assert spans[-1]["stop"] == len(text)


def test_token_bytes_are_the_raw_bytes(smollm: Tokenizer, sentencepiece: Tokenizer):
    for tok in (smollm, sentencepiece):
        ids = tok.encode("日本 😀 café", add_special_tokens=False)
        raw = [tok.token_bytes(i) for i in ids]
        assert b"".join(raw).decode() in (" 日本 😀 café", "日本 😀 café")
        assert any(len(r) and not _is_whole_utf8(r) for r in raw)  # pieces of characters stay pieces


def _is_whole_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def test_prompt_ending_inside_a_character_adds_nothing_to_the_output(smollm: Tokenizer):
    ids = smollm.encode("日本 hello world")
    cut = next(i for i in range(1, len(ids)) if smollm.decode(ids[:i]).endswith("\ufffd"))
    prompt, generated = ids[:cut], ids[cut:]
    assert "".join(_stream(smollm, prompt, generated)) == smollm.decode(generated)


def reference_texts(tokenizer: Tokenizer, prompt_ids: list[int], ids: list[int], skip_special: bool) -> list[str]:
    """What the tokenizers library's DecodeStream alone gives, token by token (no lookups)."""
    step = tokenizer.decode_stream(list(prompt_ids), skip_special).step
    return [step(token_id) or "" for token_id in ids]


@pytest.mark.parametrize("skip_special", [True, False])
def test_looked_up_texts_are_what_the_decode_stream_gives(smollm: Tokenizer, skip_special: bool):
    """Whole tokens are looked up, pieces of characters and special tokens go through the
    DecodeStream: the texts are the same as the stream's alone, token by token."""
    import random

    assert len(smollm.whole_token_texts) > 40_000  # most of the vocabulary takes the lookup
    pieces = [i for i in range(smollm.vocab_size) if i not in smollm.whole_token_texts][:400]
    rng = random.Random(7)
    vocab = range(smollm.vocab_size)
    for _ in range(40):
        ids = [rng.choice(pieces) if rng.random() < 0.3 else rng.choice(vocab) for _ in range(60)]
        ids += smollm.encode("naïve café 日本語 🎉 done", add_special_tokens=False)
        prompt = smollm.encode("The prompt:", add_special_tokens=False)
        detokenizer = IncrementalDetokenizer(smollm, prompt, skip_special)
        assert [detokenizer.add(i) for i in ids] == reference_texts(smollm, prompt, ids, skip_special)


def test_a_sentencepiece_decoder_looks_nothing_up(sentencepiece: Tokenizer, metaspace: Tokenizer):
    assert sentencepiece.whole_token_texts == {} and metaspace.whole_token_texts == {}
