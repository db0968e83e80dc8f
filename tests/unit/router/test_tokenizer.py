"""Tokenizer: the embedded GGUF against transformers, a tiny Hugging Face folder, chat templates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from loom_router.frontend.text import IncrementalDetokenizer
from loom_router.tokenizer import ChatTemplateError, Tokenizer, TokenizerLoadError, load_tokenizer

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
VARIED_TEXTS = [
    "Hello world",
    "1234567 + 89 = 12345656, 3.14159 and 2024-11-22",
    "  leading spaces\n\n\ttabs\r\n end  ",
    "héllo wörld — “quotes” … 日本語のテキスト 中文 한국어 Ελληνικά",
    "emoji 😀👍🏽 🇫🇷 family 👨‍👩‍👧",
    "def f(x):\n    return x**2  # comment\n\nif __name__ == '__main__':\n    print(f(3.14))\n",
    "I'm can't we'll they've DON'T",
    "   ",
    "\n\n\n",
    "a\u00a0b\u2003c",
    "<|im_start|>user\nhi<|im_end|>",
]
TINY_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'bad' %}"
    "{{ raise_exception('bad role') }}{% endif %}"
    "[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


@pytest.fixture(scope="module")
def smollm() -> Tokenizer:
    return load_tokenizer("")


def _write_tiny_hf(folder: Path, config: dict, generation: dict | None = None) -> Path:
    """A byte-level BPE trained on a few sentences, saved as a Hugging Face folder."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(["hello world, the quick brown fox jumps over the lazy dog"] * 20, trainer)
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


@pytest.fixture
def tiny_hf(tmp_path: Path) -> Path:
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": TINY_TEMPLATE}
    return _write_tiny_hf(tmp_path / "tiny", config, generation={"eos_token_id": [1, 5]})


def test_embedded_gguf_metadata_is_honoured(smollm: Tokenizer):
    assert smollm.eos_token_ids == (2,)  # <|im_end|>, as the GGUF says (not transformers' 1)
    assert smollm.bos_token_id == 1
    assert smollm.vocab_size == 49152
    assert smollm.encode("Hello")[0] != 1  # add_bos_token is false: no BOS
    assert smollm.is_special(2) and not smollm.is_special(100)
    assert smollm.encode("<|im_end|>", add_special_tokens=False) == [2]


def test_embedded_chat_prompt_is_37_tokens(smollm: Tokenizer):
    prompt = smollm.apply_chat_template(FRANCE, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert len(smollm.encode(prompt)) == 37  # llama.cpp's count on this GGUF (MODEL-NOTES.md)


def test_embedded_round_trip(smollm: Tokenizer):
    for text in VARIED_TEXTS:
        assert smollm.decode(smollm.encode(text)) == text
    assert smollm.decode(smollm.encode("<|im_start|>hi<|im_end|>"), skip_special_tokens=True) == "hi"


def test_vocabulary_hash_is_stable_and_discriminating(smollm: Tokenizer, tiny_hf: Path):
    tiny_hash = load_tokenizer(str(tiny_hf)).token_bytes_hash()
    assert tiny_hash == load_tokenizer(str(tiny_hf)).token_bytes_hash()  # stable across loads
    assert smollm.token_bytes_hash() != tiny_hash
    assert len(smollm.token_bytes_hash()) == 64


@pytest.mark.slow
def test_embedded_ids_match_transformers(smollm: Tokenizer):
    transformers = pytest.importorskip("transformers")
    from loom_router.tokenizer import _embedded_gguf_path

    path = _embedded_gguf_path()
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    prompt = smollm.apply_chat_template(FRANCE)
    assert prompt == ref.apply_chat_template(FRANCE, tokenize=False, add_generation_prompt=True)
    for text in [prompt, *VARIED_TEXTS]:
        assert smollm.encode(text) == ref(text, add_special_tokens=False).input_ids, text


def test_hf_folder(tiny_hf: Path):
    tok = load_tokenizer(str(tiny_hf))
    ids = tok.encode("hello world")
    assert ids[0] == 0 and tok.bos_token_id == 0  # the post-processor adds <s>
    assert tok.encode("hello world", add_special_tokens=False) == ids[1:]
    assert tok.decode(ids, skip_special_tokens=True) == "hello world"
    assert tok.decode(ids) == "<s>hello world"
    assert tok.eos_token_ids == (1, 5)  # tokenizer_config's, then generation_config's
    assert tok.is_special(0) and tok.is_special(1) and not tok.is_special(ids[1])


def test_hf_add_bos_token_false_overrides_post_processor(tmp_path: Path):
    folder = _write_tiny_hf(tmp_path / "nobos", {"bos_token": "<s>", "add_bos_token": False})
    tok = load_tokenizer(str(folder))
    assert tok.encode("hello") == tok.encode("hello", add_special_tokens=False)
    assert tok.chat_template is None


def test_hf_chat_template_renders_with_bos_and_eos(tiny_hf: Path):
    tok = load_tokenizer(str(tiny_hf))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages) == "<s>[system] Be brief.</s>\n[user] hi</s>\n[assistant] "
    assert tok.apply_chat_template(messages, add_generation_prompt=False).endswith("hi</s>\n")


def test_continuing_the_final_message_ends_the_prompt_inside_it(smollm: Tokenizer, tiny_hf: Path):
    prefill = [*FRANCE, {"role": "assistant", "content": 'The capital is "'}]
    prompt = smollm.apply_chat_template(prefill, add_generation_prompt=False, continue_final_message=True)
    assert prompt == smollm.apply_chat_template(FRANCE) + 'The capital is "'
    tok = load_tokenizer(str(tiny_hf))  # a template that writes an end of turn after every message
    assert tok.apply_chat_template(prefill, False, True).endswith('[assistant] The capital is "')
    with pytest.raises(ChatTemplateError, match="assistant message"):
        tok.apply_chat_template(FRANCE, False, True)


def test_template_variables_never_replace_loom_s(tiny_hf: Path):
    tok = load_tokenizer(str(tiny_hf))
    messages = [{"role": "user", "content": "hi"}]
    extra = {"messages": [], "bos_token": "X", "self": 1}  # "self": a name render() itself takes
    assert tok.apply_chat_template(messages, extra=extra) == tok.apply_chat_template(messages)


@pytest.mark.slow
def test_continuing_the_final_message_matches_transformers(smollm: Tokenizer):
    transformers = pytest.importorskip("transformers")
    from loom_router.tokenizer import _embedded_gguf_path

    path = _embedded_gguf_path()
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    prefill = [*FRANCE, {"role": "assistant", "content": "Paris, of"}]
    assert smollm.apply_chat_template(prefill, False, True) == ref.apply_chat_template(
        prefill, tokenize=False, continue_final_message=True)


def test_chat_template_jinja_file_wins(tiny_hf: Path):
    (tiny_hf / "chat_template.jinja").write_text("{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    assert load_tokenizer(str(tiny_hf)).apply_chat_template([{"role": "user", "content": "x"}]) == "<x>"


def test_a_multimodal_processors_chat_template_serves_where_the_tokenizer_has_none(tmp_path: Path):
    folder = _write_tiny_hf(tmp_path / "gemma3-mm", {"bos_token": "<s>"})
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": "{% for m in messages %}({{ m.content }}){% endfor %}"}))
    assert load_tokenizer(str(folder)).apply_chat_template([{"role": "user", "content": "x"}]) == "(x)"


def test_chat_template_errors_are_clear(tiny_hf: Path, tmp_path: Path):
    tok = load_tokenizer(str(tiny_hf))
    with pytest.raises(ChatTemplateError, match="bad role"):
        tok.apply_chat_template([{"role": "bad", "content": "x"}])
    no_template = load_tokenizer(str(_write_tiny_hf(tmp_path / "plain", {"bos_token": "<s>"})))
    with pytest.raises(ChatTemplateError, match="no chat template"):
        no_template.apply_chat_template(FRANCE)
    (tiny_hf / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        load_tokenizer(str(tiny_hf)).apply_chat_template(FRANCE)


def test_chat_template_is_sandboxed(tiny_hf: Path):
    (tiny_hf / "chat_template.jinja").write_text("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        load_tokenizer(str(tiny_hf)).apply_chat_template(FRANCE)


def test_chat_template_helpers(tiny_hf: Path):
    template = "{{ strftime_now('%Y') }}|{{ messages | tojson }}{% generation %}!{% endgeneration %}"
    (tiny_hf / "chat_template.jinja").write_text(template)
    year, rest = load_tokenizer(str(tiny_hf)).apply_chat_template([{"role": "user", "content": "é"}]).split("|")
    assert year.isdigit() and len(year) == 4
    assert rest == '[{"role": "user", "content": "é"}]!'


def test_missing_model_is_a_clear_error(tmp_path: Path):
    with pytest.raises(TokenizerLoadError, match="no such file"):
        load_tokenizer(str(tmp_path / "nope"))
    with pytest.raises(TokenizerLoadError, match="no tokenizer.json"):
        load_tokenizer(str(tmp_path))


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory: pytest.TempPathFactory):
    """A SentencePiece BPE model trained here, and the same vocabulary written as a "llama" GGUF."""
    spm = pytest.importorskip("sentencepiece")
    import io

    import gguf

    corpus = ["The quick brown fox jumps over the lazy dog.", "Hello world! Numbers 12345 and ünïcödé 日本語.",
              "  double  spaces and\nnewlines\ttabs"] * 50
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=model, vocab_size=400, model_type="bpe", byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, character_coverage=1.0,
        minloglevel=2, unk_id=0, bos_id=1, eos_id=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    ids = range(sp.get_piece_size())
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1 for i in ids]
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list([sp.id_to_piece(i) for i in ids])
    writer.add_token_scores([sp.get_score(i) for i in ids])
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sp, load_tokenizer(str(path))


def test_sentencepiece_gguf_matches_sentencepiece(spm_gguf):
    sp, tok = spm_gguf
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,)
    for text in ["The quick brown fox", "Hello world! 12345", "  double  spaces", "ünïcödé 日本語 😀 unseen ZQX",
                 "a\nb\tc", " lead", ""]:
        ids = tok.encode(text)
        assert ids == [1, *sp.encode(text)], text  # add_bos_token: true here
        assert tok.decode(ids, skip_special_tokens=True) == sp.decode(ids) == text


def test_sentencepiece_gguf_streams_spaces_and_byte_fallback(spm_gguf):
    _, tok = spm_gguf
    text = "The fox 😀 jumps over 日本"
    ids = tok.encode(text, add_special_tokens=False)
    prompt_ids, generated = ids[:2], ids[2:]
    detok = IncrementalDetokenizer(tok, prompt_ids)
    chunks = [detok.add(i) for i in generated] + [detok.flush()]
    assert "".join(chunks) == tok.decode(ids)[len(tok.decode(prompt_ids)) :]
    assert not any("\ufffd" in c for c in chunks)  # 😀 arrives as byte tokens <0xF0>...
    assert any(tok.token_text(i).startswith("<0x") for i in generated)
