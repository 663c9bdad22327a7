"""Tokenizers: the tiny byte-level one, GGUF vocabularies (vs HF transformers), chat templates, streaming."""

from __future__ import annotations

import json
import os

import pytest
from structlog.testing import capture_logs

from disagg.config import ConfigError
from disagg.engine import gguf_reader
from disagg.engine.models.tiny import build_tiny_tokenizer
from disagg.engine.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer, bytes_to_unicode
from disagg.types import InvalidRequest

SMOLLM2_TEXTS = [
    "Hello, world!",
    "12345 and 3.14159, x=10**9 in 2024",
    "  leading spaces\tand\ttabs\n\nnew lines  ",
    "héllo wörld — naïve café",
    "emoji 😀👍🏽 and CJK 你好，世界",
    "def f(x):\n    return x ** 2  # square\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>disagg<file_sep>",
    "I'm sure they'll say it's fine, we've done it",
    "",
]
MESSAGES = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Italy?"}]


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_tokenizer()


def stream(tokenizer: Tokenizer, prompt: list[int], output: list[int], skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt, skip)
    return [detok.add([token_id]) for token_id in output]


# ---- the tiny byte-level tokenizer --------------------------------------------------------------


def test_tiny_encodes_bytes_with_bos(tiny):
    assert tiny.encode("Hi") == [256, 72, 105]
    assert tiny.encode("Hi", add_special_tokens=False) == [72, 105]
    assert tiny.encode("é😀") == [256, 195, 169, 240, 159, 152, 128]
    assert tiny.encode("<|im_start|>x<|im_end|>", add_special_tokens=False) == [258, 120, 259]
    assert tiny.encode("") == [256]


def test_tiny_decode_and_facts(tiny):
    assert tiny.decode([256, 72, 258, 105]) == "Hi"
    assert tiny.decode([256, 72, 258, 105], skip_special_tokens=False) == "<bos>H<|im_start|>i"
    assert tiny.decode([0xC3]) == "\ufffd"  # half of "é"
    assert (tiny.vocab_size, tiny.bos_token_id, tiny.eos_token_ids) == (320, 256, (257, 259))
    assert tiny.special_token_ids == frozenset(range(256, 320))
    assert [tiny.id_to_token(i) for i in (72, 32, 10, 256, 319)] == ["H", "Ġ", "Ċ", "<bos>", "<|reserved_59|>"]
    with pytest.raises(InvalidRequest, match=r"^token id 320 is out of vocabulary \(vocab_size=320\)$"):
        tiny.id_to_token(320)


def test_tiny_chat_template(tiny):
    text = tiny.apply_chat_template(MESSAGES[:1])
    assert text == "<bos><|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    no_prompt = tiny.apply_chat_template(MESSAGES[:1], add_generation_prompt=False)
    assert no_prompt == "<bos><|im_start|>user\nWhat is the capital of France?<|im_end|>\n"


def test_tiny_save_and_read_back(tmp_path, tiny):
    tiny.save(str(tmp_path))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["add_bos_token"]) == ("<bos>", "<eos>", True)
    back = Tokenizer.from_hf_folder(str(tmp_path))
    assert back.encode("Hi <|im_end|>") == [256, 72, 105, 32, 259]
    assert (back.bos_token_id, back.eos_token_ids) == (256, (257,))  # extra EOS ids live in generation_config


# ---- chat templates -----------------------------------------------------------------------------


def with_template(tiny: Tokenizer, template: str | None) -> Tokenizer:
    return Tokenizer(tiny.backend, tiny.bos_token_id, tiny.eos_token_ids, template)


def test_chat_template_errors(tiny):
    strict = with_template(tiny, "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}ok")
    assert strict.apply_chat_template(MESSAGES) == "ok"
    with pytest.raises(ChatTemplateError) as err:
        strict.apply_chat_template([{"role": "assistant", "content": "hi"}])
    assert (str(err.value), err.value.param) == ("chat template failed: first message must be from the user", "messages")
    with pytest.raises(ChatTemplateError, match=r"^this model has no chat template; send a plain prompt instead$"):
        with_template(tiny, None).apply_chat_template(MESSAGES)


def test_chat_template_kwargs_are_template_variables(tiny):
    thinking = with_template(tiny, "{% if enable_thinking is defined and not enable_thinking %}/no_think {% endif %}"
                                   "{{ messages[0]['content'] }}{{ bos_token }}")
    assert thinking.apply_chat_template(MESSAGES) == MESSAGES[0]["content"] + "<bos>"
    assert thinking.apply_chat_template(MESSAGES, template_kwargs={"enable_thinking": False}) == \
        "/no_think " + MESSAGES[0]["content"] + "<bos>"
    # Unused keys are harmless; the request's messages and the special tokens are never replaced.
    assert thinking.apply_chat_template(MESSAGES, template_kwargs={"other": 1, "messages": [], "bos_token": "x"}) == \
        MESSAGES[0]["content"] + "<bos>"


def test_chat_template_helpers_match_hf(tiny):
    template = "{{ messages | tojson }}|{{ eos_token }}{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}"
    rendered = with_template(tiny, template).apply_chat_template([{"role": "user", "content": "<b>&</b> é"}, {"role": "x"}])
    assert rendered == '[{"role": "user", "content": "<b>&</b> é"}, {"role": "x"}]|<eos>user'


def test_hf_folder_chat_template_sources(tmp_path, tiny):
    tiny.backend.save(str(tmp_path / "tokenizer.json"))
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "default"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named, "eos_token": {"content": "<eos>"}}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [259, 257]}))
    tok = Tokenizer.from_hf_folder(str(tmp_path))
    assert (tok.apply_chat_template(MESSAGES), tok.bos_token_id, tok.eos_token_ids) == ("default", None, (257, 259))
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "chat_template.jinja").write_text("from the jinja file")
    assert Tokenizer.from_hf_folder(str(tmp_path)).apply_chat_template(MESSAGES) == "from the jinja file"


# ---- GGUF vocabularies --------------------------------------------------------------------------


def gguf_meta(pre: str, **extra) -> dict:
    """A byte-level vocabulary: 256 bytes, merges to '12' and 'ĠĠ', one control and one user-defined token."""
    tokens = [bytes_to_unicode()[b] for b in range(256)] + ["12", "ĠĠ", "<|ctl|>", "<think>", "a b"]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1] * 258 + [3, 4, 4], "tokenizer.ggml.merges": ["1 2", "Ġ Ġ"],
            "tokenizer.ggml.bos_token_id": 258, "tokenizer.ggml.eos_token_id": 258} | extra


def test_gguf_pre_tokenizers_split_digits_as_named():
    smollm = Tokenizer.from_gguf(gguf_meta("smollm"))
    assert smollm.encode("12") == [ord("1"), ord("2")]  # Digits(individual_digits=True) first
    assert Tokenizer.from_gguf(gguf_meta("gpt2")).encode("12") == [256]
    llama3 = Tokenizer.from_gguf(gguf_meta("llama-bpe"))
    assert llama3.encode("12") == [258, 256]  # Llama 3 adds BOS unless the file says otherwise
    assert Tokenizer.from_gguf(gguf_meta("llama-bpe", **{"tokenizer.ggml.add_bos_token": False})).encode("12") == [256]


def test_gguf_control_and_user_defined_tokens():
    tok = Tokenizer.from_gguf(gguf_meta("smollm", **{"tokenizer.ggml.eot_token_id": 259}))
    assert tok.encode("x<|ctl|><think>") == [ord("x"), 258, 259]
    assert tok.decode([ord("x"), 258, 259]) == "x<think>"  # user-defined tokens are not special
    assert (tok.special_token_ids, tok.eos_token_ids, tok.vocab_size) == (frozenset({258}), (258, 259), 261)
    assert tok.id_to_token(260) == "aĠb"  # a token spelled outside the byte alphabet is respelled
    assert tok.encode("   ", add_special_tokens=False) == [257, 32]  # merge "Ġ Ġ", then a lone "Ġ" (byte 32)


def test_gguf_unknown_pre_tokenizer_warns_and_unsupported_model_refused():
    with capture_logs() as logs:
        tok = Tokenizer.from_gguf(gguf_meta("mystery"))
    assert tok.encode("12") == [256]
    assert [(e["event"], e["pre"]) for e in logs] == [("unknown GGUF pre-tokenizer; using GPT-2's, tokens may differ from llama.cpp", "mystery")]
    with pytest.raises(ConfigError, match=r"^GGUF tokenizer model 'llama' is not supported; supported: 'gpt2' \(byte-level BPE\)$"):
        gguf_reader.read_vocab(gguf_meta("smollm", **{"tokenizer.ggml.model": "llama"}))


# ---- streaming decode ---------------------------------------------------------------------------


def test_incremental_detokenizer_holds_back_split_utf8(tiny):
    text = "ok 😀 é!"
    ids = tiny.encode(text, add_special_tokens=False)
    pieces = stream(tiny, tiny.encode("prompt"), ids)
    assert "".join(pieces) == text == tiny.decode(ids)
    assert pieces[3:8] == ["", "", "", "😀", " "]  # the emoji's four bytes come out together
    assert not any("\ufffd" in p for p in pieces)


def test_incremental_detokenizer_special_tokens(tiny):
    ids = [72, 259, 105, 256]
    assert stream(tiny, [256], ids) == ["H", "", "i", ""]
    assert stream(tiny, [256], ids, skip=False) == ["H", "<|im_end|>", "i", "<bos>"]


@pytest.fixture(scope="module")
def hf_smollm2():
    from transformers import AutoTokenizer

    from disagg.engine.loader import resolve_model_path

    path = resolve_model_path("smollm2-135m")
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@pytest.mark.slow
def test_smollm2_tokenizer_equals_transformers(smollm2_loaded, hf_smollm2):
    ours = smollm2_loaded.tokenizer
    for text in SMOLLM2_TEXTS:
        ids = ours.encode(text)
        assert ids == hf_smollm2.encode(text), text
        assert ours.decode(ids, skip_special_tokens=False) == hf_smollm2.decode(ids) == text
        assert ours.decode(ids) == hf_smollm2.decode(ids, skip_special_tokens=True)
    assert ours.encode("12345") == [33, 34, 35, 36, 37]
    assert ours.encode("<|im_start|>user") == [1, 4093]
    assert (ours.bos_token_id, ours.eos_token_ids, ours.vocab_size) == (1, (2,), 49152)
    assert ours.special_token_ids == frozenset(range(17))


@pytest.mark.slow
def test_smollm2_chat_template_equals_transformers(smollm2_loaded, hf_smollm2):
    ours = smollm2_loaded.tokenizer.apply_chat_template(MESSAGES)
    assert ours == hf_smollm2.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert ours.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert ours.endswith("<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_smollm2_streaming_decode_of_emoji(smollm2_loaded):
    tok = smollm2_loaded.tokenizer
    text = "Sure! 😀👍🏽 Ça va? 你好"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # the emoji are split across byte tokens
    pieces = stream(tok, tok.encode("<|im_start|>assistant\n"), ids)
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
