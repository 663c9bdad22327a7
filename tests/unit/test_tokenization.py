"""The worker's tokenize/detokenize utilities on the tiny tokenizer: exact ids and refusals."""

import msgspec
import pytest

from disagg.worker.tokenization import detokenize, tokenize
from disagg.engine.models.tiny import build_tiny_tokenizer
from disagg.engine.tokenizer import Tokenizer
from disagg.wire.engine_msgs import TokenizeMsg


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    return build_tiny_tokenizer()


def run(tokenizer: Tokenizer, **fields) -> dict:
    return tokenize(tokenizer, msgspec.to_builtins(TokenizeMsg(**fields)))  # as it crosses the wire


def test_prompt_ids_and_strings(tiny):
    assert run(tiny, prompt="Hi") == {"tokens": [256, 72, 105]}
    assert run(tiny, prompt="Hi y", add_special_tokens=False, return_token_strs=True) == {
        "tokens": [72, 105, 32, 121], "token_strs": ["H", "i", "Ġ", "y"]}
    assert run(tiny, prompt="") == {"tokens": [256]}


def test_continue_final_message_ends_after_its_content(tiny):
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    closed = run(tiny, messages=chat, add_special_tokens=False, add_generation_prompt=False)["tokens"]
    open_ = run(tiny, messages=chat, add_special_tokens=False, add_generation_prompt=False,
                continue_final_message=True)["tokens"]
    assert closed[len(open_):] == [259, 10]  # <|im_end|> and the newline are left out
    assert open_[-2:] == [89, 111]


def test_continue_final_message_keeps_trailing_whitespace_the_template_keeps(tiny):
    """HF's order: the content as given ("Sure, " keeps its space), then stripped for a template that
    trims messages."""
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure, "}]
    tokens = run(tiny, messages=chat, add_special_tokens=False, add_generation_prompt=False,
                 continue_final_message=True)["tokens"]
    assert tokens[-2:] == [44, 32]  # ',' and ' '
    trimming = Tokenizer(tiny.backend, tiny.bos_token_id, tiny.eos_token_ids,
                         "{% for m in messages %}[{{ m['content'] | trim }}]{% endfor %}")
    assert detokenize(trimming, run(trimming, messages=chat, add_special_tokens=False, add_generation_prompt=False,
                                    continue_final_message=True)["tokens"]) == "[Hi][Sure,"


def test_refusals_are_results_not_exceptions(tiny):
    bare = Tokenizer(tiny.backend, tiny.bos_token_id, tiny.eos_token_ids, None)
    assert run(bare, messages=[{"role": "user", "content": "Hi"}]) == {
        "error": "this model has no chat template; send a plain prompt instead", "error_param": "messages"}
    echoing = Tokenizer(tiny.backend, tiny.bos_token_id, tiny.eos_token_ids, "{{ messages[0]['content'] | upper }}")
    assert run(echoing, messages=[{"role": "user", "content": "hi"}], add_generation_prompt=False,
               continue_final_message=True) == {
        "error": "continue_final_message: the chat template does not render the final message's content as given",
        "error_param": "messages"}
    assert run(tiny) == {"error": "send a prompt or messages", "error_param": "prompt"}


def test_detokenize_keeps_special_tokens(tiny):
    assert detokenize(tiny, [256, 72, 105, 257]) == "<bos>Hi<eos>"
    assert detokenize(tiny, []) == ""
