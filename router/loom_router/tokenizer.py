"""The router's tokenizer: built from a GGUF file's metadata or a Hugging Face folder,
with the model's own BOS/EOS rules and its chat template rendered in a jinja2 sandbox."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from datetime import datetime
from functools import cached_property, partial
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend
from tokenizers.decoders import DecodeStream

from loom_proto.embedded import EmbeddedModelMissing, embedded_model_path, is_default_model_id
from loom_proto.gguf_header import GGUFFormatError, read_metadata

# GGUF token types (llama.cpp's llama_token_type)
_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER_DEFINED, _TOKEN_BYTE = 1, 3, 4, 6

# Split regexes of llama.cpp's pre-tokenizers (tokenizer.ggml.pre), applied before byte-level BPE.
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp splits every digit apart, then applies the GPT-2 regex, for these.
_DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_IGNORE_MERGES_PRE = ("llama3", "llama-bpe")  # llama.cpp looks whole words up before merging
_REGEX_PRE = {"llama3": _LLAMA3_REGEX, "llama-bpe": _LLAMA3_REGEX, "falcon3": _LLAMA3_REGEX, "qwen2": _QWEN2_REGEX}


class TokenizerLoadError(Exception):
    """The tokenizer files are missing or of a kind Loom does not read."""


class ChatTemplateError(Exception):
    """The model has no chat template, or the template failed on these messages."""


class Tokenizer:
    """Text <-> token ids for one model, plus its BOS/EOS ids and chat template."""

    def __init__(
        self,
        backend: Backend,
        eos_token_ids: tuple[int, ...],
        bos_token_id: int | None,
        chat_template: str | None,
    ) -> None:
        self._backend = backend
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        added = backend.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, token in added.items() if token.special)
        self._compiled_template: jinja2.Template | None = None
        self._byte_level = _is_byte_level(backend.decoder)
        self._only_byte_level = _is_byte_level(backend.decoder, alone=True)

    def encode(self, text: str, add_special_tokens: bool = True, truncate: int | None = None) -> list[int]:
        """Token ids of `text`; special tokens written in the text are recognized.

        truncate: keep only the last tokens of the text, so that with the model's own
        special tokens (its BOS, which survives) there are at most this many.
        """
        return self._encoding(text, add_special_tokens, truncate).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def encode_with_offsets(self, text: str, truncate: int | None = None) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of `text` with each token's character span in it (special tokens: (0, 0))."""
        encoding = self._encoding(text, True, truncate)
        return encoding.ids, encoding.offsets

    def _encoding(self, text: str, add_special_tokens: bool, truncate: int | None) -> Any:
        if truncate is None:
            return self._backend.encode(text, add_special_tokens=add_special_tokens)
        # Truncate the text's tokens, then add the specials: slicing after them would drop BOS.
        encoding = self._backend.encode(text, add_special_tokens=False)
        num_special = self._backend.num_special_tokens_to_add(False) if add_special_tokens else 0
        encoding.truncate(max(truncate - num_special, 1), direction="left")
        return self._backend.post_process(encoding) if add_special_tokens else encoding

    def decode_stream(self, context_ids: list[int], skip_special_tokens: bool = True) -> TokenStream:
        """A streaming decoder that continues after context_ids (see IncrementalDetokenizer)."""
        return TokenStream(self._backend, DecodeStream(ids=context_ids, skip_special_tokens=skip_special_tokens))

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (part of a UTF-8 character for some), as OpenAI's
        logprobs `bytes` report them: byte-level BPE maps its symbols back to bytes,
        SentencePiece reads `<0xXX>` pieces and `▁` as a space."""
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self.special_ids:
            return piece.encode()
        if self._byte_level:
            return bytes(_BYTE_LEVEL_DECODE.get(ch, 0) for ch in piece)
        match = _BYTE_PIECE.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        return piece.replace("▁", " ").encode()

    @cached_property
    def whole_token_texts(self) -> dict[int, str]:
        """The text of every token that adds the same text wherever it comes, as long as the
        text before it ended on a whole character: with a decoder that only maps byte-level
        symbols back to bytes, a vocabulary token whose bytes are whole UTF-8 characters. Empty
        for other decoders (SentencePiece's strips a leading space at the start, for one);
        added tokens are never in it. Built once (~0.1 s for 150k tokens), on first use."""
        if not self._only_byte_level:
            return {}
        added = set(self._backend.get_added_tokens_decoder())
        texts: dict[int, str] = {}
        for token_id in range(self._backend.get_vocab_size(with_added_tokens=False)):
            piece = self._backend.id_to_token(token_id)
            if piece is None or token_id in added:
                continue
            try:
                texts[token_id] = bytes(_BYTE_LEVEL_DECODE[ch] for ch in piece).decode()
            except (KeyError, UnicodeDecodeError):  # not a byte-level symbol, or part of a character
                continue
        return texts

    def backend_json(self) -> str:
        """The whole tokenizer as Hugging Face tokenizer.json text (what grammar engines load)."""
        return self._backend.to_str()

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_ids

    def token_text(self, token_id: int) -> str | None:
        """The vocabulary entry of an id (byte-level or SentencePiece form), None when out of range."""
        return self._backend.id_to_token(token_id)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, continue_final_message: bool = False,
        extra: dict[str, Any] | None = None,
    ) -> str:
        """Renders messages with the model's template; `extra` variables (tools, documents...) are
        passed on, under the ones the template gets from Loom (messages, add_generation_prompt, the
        model's bos_token and eos_token). continue_final_message: the prompt ends inside the final
        (assistant) message, for the answer to go on from its text, as transformers does.

        Raises ChatTemplateError when there is no template or it fails on these messages.
        """
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template; send a plain prompt instead")
        template = self._template()
        variables = {**(extra or {}), "messages": messages, "add_generation_prompt": add_generation_prompt,
                     "bos_token": self._token_string(self.bos_token_id),
                     "eos_token": self._token_string(self.eos_token_ids[0] if self.eos_token_ids else None)}
        try:
            prompt = template.render(variables)
        except Exception as e:  # template code runs on user input: any failure is the request's fault
            raise ChatTemplateError(f"the chat template failed on these messages: {e}") from e
        return _up_to_final_message(prompt, messages) if continue_final_message else prompt

    def token_bytes_hash(self) -> str:
        """sha256 of the vocabulary (every token's text, in id order): a stable fingerprint."""
        vocab = self._backend.get_vocab(with_added_tokens=True)
        ordered = sorted(vocab.items(), key=lambda item: item[1])
        return hashlib.sha256(json.dumps(ordered, ensure_ascii=False).encode()).hexdigest()

    def _token_string(self, token_id: int | None) -> str:
        return "" if token_id is None else (self._backend.id_to_token(token_id) or "")

    def _template(self) -> jinja2.Template:
        if self._compiled_template is None:
            try:
                self._compiled_template = _jinja_environment().from_string(self.chat_template or "")
            except jinja2.TemplateError as e:
                raise ChatTemplateError(f"the model's chat template does not compile: {e}") from e
        return self._compiled_template


class TokenStream:
    """One sequence's `DecodeStream`, bound to its tokenizer.

    `step(token_id)`: the text token_id completes, or None while it completes nothing yet (the
    stream's own step with the backend bound in C: no Python frame per token).
    """

    __slots__ = ("step",)

    def __init__(self, backend: Backend, stream: DecodeStream) -> None:
        self.step: Callable[[int], str | None] = partial(stream.step, backend)


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet read backwards: printable symbol -> the byte it stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {chr(code): byte for byte, code in zip(printable, codes)}


_BYTE_LEVEL_DECODE = _gpt2_byte_decoder()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _is_byte_level(decoder: Any, alone: bool = False) -> bool:
    """Does this decoder (or one in its Sequence, unless `alone`) map GPT-2 byte symbols back
    to bytes?"""
    if decoder is None:
        return False
    try:
        state = json.loads(decoder.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return isinstance(decoder, decoders.ByteLevel)
    if alone:
        return state.get("type") == "ByteLevel"
    parts = state.get("decoders", [state]) if state.get("type") == "Sequence" else [state]
    return any(part.get("type") == "ByteLevel" for part in parts)


def load_tokenizer(model_id: str) -> Tokenizer:
    """The tokenizer of a GGUF file, a Hugging Face folder, or "" for the embedded default."""
    path = _resolve(model_id)
    if path.is_file():
        return tokenizer_from_gguf(path)
    if (path / "tokenizer.json").is_file():
        return tokenizer_from_hf_folder(path)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return tokenizer_from_gguf(ggufs[0])
    raise TokenizerLoadError(f"{path}: no tokenizer.json and not exactly one .gguf file")


def _resolve(model_id: str) -> Path:
    if is_default_model_id(model_id):
        return _embedded_gguf_path()
    path = Path(model_id).expanduser()
    if not path.exists():
        raise TokenizerLoadError(f"{model_id}: no such file or folder")
    return path


def _embedded_gguf_path() -> Path:
    try:
        return embedded_model_path()
    except EmbeddedModelMissing as error:
        raise TokenizerLoadError(f"the embedded default model is missing: {error}") from None


# ---- GGUF -----------------------------------------------------------------------------------


def tokenizer_from_gguf(path: Path) -> Tokenizer:
    """Builds the tokenizer from GGUF metadata, following llama.cpp's reading of it."""
    meta = _gguf_tokenizer_metadata(path)
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(tokens)
    if kind == "gpt2":
        backend = _byte_level_bpe(tokens, meta.get("tokenizer.ggml.merges") or [], meta.get("tokenizer.ggml.pre"))
    elif kind == "llama":
        scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        backend = _sentencepiece_bpe(tokens, scores, types, meta.get("tokenizer.ggml.add_space_prefix", True))
    else:
        raise TokenizerLoadError(f"{path}: tokenizer model {kind!r} is not supported (gpt2, llama are)")
    _add_gguf_special_tokens(backend, tokens, types)
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")  # llama.cpp's defaults
    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    add_eos = meta.get("tokenizer.ggml.add_eos_token", False)
    _set_bos_eos_template(backend, bos_id if add_bos else None, eos_id if add_eos else None)
    eos_ids = [meta.get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    return Tokenizer(
        backend,
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos_ids if i is not None)),
        bos_token_id=None if bos_id is None else int(bos_id),
        chat_template=meta.get("tokenizer.chat_template"),
    )


def _gguf_tokenizer_metadata(path: Path) -> dict[str, Any]:
    try:
        return read_metadata(path, prefix="tokenizer.")
    except (OSError, GGUFFormatError) as e:  # a damaged or foreign file: say which, in one line
        raise TokenizerLoadError(f"{path}: not a readable GGUF file ({e})") from e


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str | None) -> Backend:
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = Backend(models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre in _IGNORE_MERGES_PRE))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    return backend


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer llama.cpp uses for `tokenizer.ggml.pre` (GPT-2's for unknown names)."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in _REGEX_PRE:
        split = pre_tokenizers.Split(Regex(_REGEX_PRE[pre]), behavior="isolated", invert=False)
        return pre_tokenizers.Sequence([split, byte_level])
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    return gpt2


def _sentencepiece_bpe(tokens: list[str], scores: list[float], types: list[int], add_space_prefix: bool) -> Backend:
    """A SentencePiece BPE model: merges ranked by the merged piece's score, bytes as <0xXX>."""
    vocab = {token: i for i, token in enumerate(tokens)}
    mergeable = {t: s for t, s, k in zip(tokens, scores, types) if k in (_TOKEN_NORMAL, _TOKEN_USER_DEFINED)}
    ranked = []
    for piece, score in mergeable.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in mergeable and right in mergeable:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    ranked.sort()
    unk = next((t for t, k in zip(tokens, types) if k == 2), None)  # type 2: unknown
    backend = Backend(
        models.BPE(vocab=vocab, merges=[(r[3], r[4]) for r in ranked], unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    steps = [normalizers.Prepend("▁")] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    strip = [decoders.Strip(content=" ", left=1, right=0)] if add_space_prefix else []
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()] + strip
    )
    return backend


def _add_gguf_special_tokens(backend: Backend, tokens: list[str], types: list[int]) -> None:
    # Control tokens are special (skipped on request); user-defined ones are matched whole.
    control = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _TOKEN_CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _TOKEN_USER_DEFINED]
    backend.add_special_tokens(control)
    backend.add_tokens(user)


def _set_bos_eos_template(backend: Backend, bos_id: int | None, eos_id: int | None) -> None:
    """Makes encode(add_special_tokens=True) add exactly the BOS/EOS the model asks for."""
    single, specials = "$A", []
    if bos_id is not None:
        bos = backend.id_to_token(bos_id)
        single, specials = f"{bos} {single}", [(bos, bos_id)]
    if eos_id is not None:
        eos = backend.id_to_token(eos_id)
        single, specials = f"{single} {eos}", specials + [(eos, eos_id)]
    backend.post_processor = processors.TemplateProcessing(single=single, special_tokens=list(dict.fromkeys(specials)))


# ---- Hugging Face folder --------------------------------------------------------------------


def tokenizer_from_hf_folder(folder: Path) -> Tokenizer:
    """tokenizer.json + tokenizer_config.json (+ chat_template.jinja, generation_config.json)."""
    backend = Backend.from_file(str(folder / "tokenizer.json"))
    config = _read_json(folder / "tokenizer_config.json")
    bos_id = _token_id(backend, config.get("bos_token"))
    eos_id = _token_id(backend, config.get("eos_token"))
    if "add_bos_token" in config or "add_eos_token" in config:
        _honour_add_flags(backend, config, bos_id, eos_id)
    eos_ids = [] if eos_id is None else [eos_id]
    generation_eos = _read_json(folder / "generation_config.json").get("eos_token_id")
    eos_ids += generation_eos if isinstance(generation_eos, list) else [generation_eos]
    return Tokenizer(
        backend,
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos_ids if i is not None)),
        bos_token_id=bos_id,
        chat_template=_hf_chat_template(folder, config),
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TokenizerLoadError(f"{path}: unreadable JSON ({e})") from e


def _token_id(backend: Backend, token: str | dict | None) -> int | None:
    content = token.get("content") if isinstance(token, dict) else token
    return None if content is None else backend.token_to_id(content)


def _honour_add_flags(backend: Backend, config: dict[str, Any], bos_id: int | None, eos_id: int | None) -> None:
    """Rebuilds the post-processor when tokenizer_config's add_bos/add_eos disagree with it
    (transformers does the same for Llama-style tokenizers)."""
    want_bos = bool(config.get("add_bos_token")) and bos_id is not None
    want_eos = bool(config.get("add_eos_token")) and eos_id is not None
    probe = backend.encode("a", add_special_tokens=True).ids
    has_bos = bos_id is not None and probe[:1] == [bos_id]
    has_eos = eos_id is not None and probe[-1:] == [eos_id]
    if (want_bos, want_eos) != (has_bos, has_eos):
        _set_bos_eos_template(backend, bos_id if want_bos else None, eos_id if want_eos else None)


def _hf_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one serves chat
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None:
        template = _processor_chat_template(folder)
    return template if isinstance(template, str) else None


def _processor_chat_template(folder: Path) -> str | None:
    """A multimodal model's processor template (chat_template.json), where its tokenizer has none."""
    path = folder / "chat_template.json"
    try:
        template = json.loads(path.read_text(encoding="utf-8")).get("chat_template") if path.is_file() else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None
    return template if isinstance(template, str) else None


# ---- chat templates -------------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """Accepts HF's {% generation %}...{% endgeneration %} marker and renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _up_to_final_message(prompt: str, messages: list[dict]) -> str:
    """The rendered prompt cut after the final message's text (the template's end of turn gone)."""
    final = messages[-1] if messages else {}
    text = final.get("content")
    if final.get("role") != "assistant" or not isinstance(text, str) or not text.strip():
        raise ChatTemplateError("continuing the final message needs it to be an assistant message with text")
    for piece in (text, text.strip()):  # some templates strip the content they write
        at = prompt.rfind(piece)
        if at >= 0:
            return prompt[: at + len(piece)]
    raise ChatTemplateError("the chat template does not write the final message's text, so it cannot be continued")


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)


def _jinja_environment() -> jinja2.Environment:
    """A sandbox set up as transformers sets up chat templates."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    globals_: dict[str, Callable[..., Any]] = {
        "raise_exception": _raise_exception,
        "strftime_now": lambda fmt: datetime.now().strftime(fmt),
    }
    env.globals.update(globals_)
    return env
