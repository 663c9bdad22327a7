"""Text ↔ token ids for one model: encoding, decoding, the chat template and streaming decode.

`Tokenizer` wraps a `tokenizers.Tokenizer` (the Rust library HF's fast tokenizers use) plus the few
facts a serving engine needs beside it: which ids end generation, whether BOS is added, and the
chat template. It is built from an HF folder, from GGUF metadata, or in code (the tiny model).
No torch here, so a front-door process can tokenize without loading the model stack.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cached_property
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import processors

from disagg.types import InvalidRequest

# How many prompt tokens the streaming decoder re-decodes as context (vLLM uses the same numbers).
_PREFIX_CONTEXT_TOKENS = 5
_PROMPT_TAIL_TOKENS = _PREFIX_CONTEXT_TOKENS + 2


class ChatTemplateError(InvalidRequest):
    """The chat template refused the messages (`raise_exception`) or the model has no template."""

    def __init__(self, message: str):
        super().__init__(message, "messages")


class Tokenizer:
    """One model's tokenizer: `encode`, `decode`, `apply_chat_template` and the special ids."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        chat_template: str | None,
    ):
        """`backend` must already add BOS (through its post-processor) exactly when the model wants it."""
        self.backend = backend
        self._bos_token_id = bos_token_id
        self._eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        self.chat_template = chat_template

    # ---- constructors -------------------------------------------------------------------------

    @classmethod
    def from_hf_folder(cls, path: str) -> Tokenizer:
        """Read tokenizer.json, tokenizer_config.json, generation_config.json and chat_template.jinja."""
        backend = tokenizers.Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        bos_id = _token_id(backend, config.get("bos_token"))
        eos_id = _token_id(backend, config.get("eos_token"))
        if "add_bos_token" in config or "add_eos_token" in config:
            # As transformers' Llama tokenizer does: these flags override tokenizer.json's template.
            backend.post_processor = bos_eos_processor(
                backend, bos_id if config.get("add_bos_token") else None, eos_id if config.get("add_eos_token") else None
            )
        generation = _read_json(os.path.join(path, "generation_config.json"))
        extra = generation.get("eos_token_id")
        extra_ids = [] if extra is None else [extra] if isinstance(extra, int) else list(extra)
        eos_ids = ([eos_id] if eos_id is not None else []) + extra_ids
        return cls(backend, bos_id, eos_ids, _hf_chat_template(path, config))

    @classmethod
    def from_gguf(cls, reader_or_fields: Any) -> Tokenizer:
        """From a `gguf.GGUFReader` or its metadata as plain values (`gguf_reader.read_metadata`)."""
        from disagg.engine import gguf_reader  # numpy and gguf only; no torch

        fields = reader_or_fields
        if hasattr(fields, "fields"):
            fields = gguf_reader.read_metadata(fields)
        vocab = gguf_reader.read_vocab(fields)
        return cls(vocab.backend, vocab.bos_token_id, vocab.eos_token_ids, vocab.chat_template)

    # ---- encoding and decoding ----------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, BOS is added when the model says so."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`; incomplete UTF-8 sequences come out as U+FFFD."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary entry of `token_id` as the vocabulary spells it (byte-level: 'Ġhello')."""
        token = self.backend.id_to_token(token_id)
        if token is None:
            raise InvalidRequest(f"token id {token_id} is out of vocabulary (vocab_size={self.vocab_size})", "token_id")
        return token

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary entry, or None."""
        return self.backend.token_to_id(token)

    # ---- facts --------------------------------------------------------------------------------

    @cached_property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (may be below the model's embedding rows)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        """The BOS id, or None when the model has none (Qwen)."""
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation: the tokenizer's EOS first, then the generation config's."""
        return self._eos_token_ids

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        """Ids that `skip_special_tokens` removes: the added tokens marked special."""
        added = self.backend.get_added_tokens_decoder()
        return frozenset(i for i, token in added.items() if token.special)

    # ---- chat ---------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            template_kwargs: Mapping[str, Any] | None = None) -> str:
        """Render `messages` with the model's chat template, as HF's `apply_chat_template(tokenize=False)`;
        `template_kwargs` (vLLM's `chat_template_kwargs`) are extra template variables, which a
        template that does not use them ignores; they never replace `messages` or the special tokens."""
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template; send a plain prompt instead")
        variables: dict[str, Any] = {**(template_kwargs or {}), "messages": messages,
                                     "add_generation_prompt": add_generation_prompt}
        if self._bos_token_id is not None:
            variables["bos_token"] = self.backend.id_to_token(self._bos_token_id)
        if self._eos_token_ids:
            variables["eos_token"] = self.backend.id_to_token(self._eos_token_ids[0])
        try:
            return self._template.render(**variables)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    @cached_property
    def _template(self) -> jinja2.Template:
        return compile_chat_template(self.chat_template)

    # ---- writing ------------------------------------------------------------------------------

    def save(self, folder: str) -> None:
        """Write tokenizer.json and tokenizer_config.json so `from_hf_folder` reads this tokenizer back.

        Only the first EOS id is written; extra EOS ids belong in the model's generation_config.json.
        """
        os.makedirs(folder, exist_ok=True)
        self.backend.save(os.path.join(folder, "tokenizer.json"))
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
        if self._bos_token_id is not None:
            config["bos_token"] = self.backend.id_to_token(self._bos_token_id)
            config["add_bos_token"] = self.encode("", add_special_tokens=True)[:1] == [self._bos_token_id]
        if self._eos_token_ids:
            config["eos_token"] = self.backend.id_to_token(self._eos_token_ids[0])
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, ensure_ascii=False, indent=2)


class IncrementalDetokenizer:
    """Streaming decode: `add(new_ids)` returns only the text those ids complete.

    vLLM's prefix/read-offset algorithm: decode a short window ending at the last emitted token and
    the same window plus the new tokens, and emit the difference. Decoding a window (not one token)
    keeps the spaces that SentencePiece-style decoders attach to the next word, and text that ends
    in U+FFFD (a UTF-8 sequence split across tokens) is held back until the sequence completes.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skipped = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._ids = [i for i in prompt_ids if i not in self._skipped][-_PROMPT_TAIL_TOKENS:]
        self._read_offset = len(self._ids)
        self._prefix_offset = max(self._read_offset - _PREFIX_CONTEXT_TOKENS, 0)

    def add(self, new_ids: Iterable[int]) -> str:
        """Append generated ids; return the new text they complete (possibly '')."""
        pieces = []
        for token_id in new_ids:
            if token_id in self._skipped:
                continue
            self._ids.append(token_id)
            pieces.append(self._advance())
        return "".join(pieces)

    def _advance(self) -> str:
        decode = self._tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=False)
        full = decode(self._ids[self._prefix_offset :], skip_special_tokens=False)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        # Trim what is no longer inside the window so a long generation keeps a short list.
        del self._ids[: self._prefix_offset]
        self._read_offset -= self._prefix_offset
        self._prefix_offset = 0
        return full[len(prefix) :]


def bos_eos_processor(
    backend: tokenizers.Tokenizer, bos_id: int | None, eos_id: int | None
) -> processors.TemplateProcessing:
    """A post-processor that wraps each sequence in BOS/EOS (either may be None: not added)."""
    specials = [(backend.id_to_token(i), i) for i in (bos_id, eos_id) if i is not None]
    bos = [backend.id_to_token(bos_id)] if bos_id is not None else []
    eos = [backend.id_to_token(eos_id)] if eos_id is not None else []
    single = bos + ["$A:0"] + eos
    pair = single + bos + ["$B:1"] + eos
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in a sandbox with the helpers HF templates expect."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character table that byte-level BPE vocabularies are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False
) -> str:
    # HF's override: jinja2's own tojson escapes HTML characters, which changes the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_id(backend: tokenizers.Tokenizer, token: str | Mapping[str, Any] | None) -> int | None:
    # tokenizer_config.json spells a special token as a string or as an AddedToken dict.
    if isinstance(token, Mapping):
        token = token.get("content")
    return backend.token_to_id(token) if token else None


def _hf_chat_template(path: str, config: Mapping[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {entry["name"]: entry["template"] for entry in template}
        template = named.get("default")
    if template is None and os.path.exists(os.path.join(path, "chat_template.jinja")):
        with open(os.path.join(path, "chat_template.jinja"), encoding="utf-8") as f:
            template = f.read()
    return template


def bad_words_token_ids(tokenizer: Tokenizer, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """vLLM's tokenization of bad words: each word as is, and with a leading space when that makes
    a different first token of the same length (so the word is banned mid-text too)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        out.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return tuple(out)
