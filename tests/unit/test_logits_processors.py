"""Penalties, logit_bias, bad_words and allowed_token_ids: exact rows, and greedy outputs equal to
HF transformers with the same processors (HF's RepetitionPenaltyLogitsProcessor and
NoBadWordsLogitsProcessor; presence/frequency/bias/allowed ids by a reference LogitsProcessor)."""

import pytest
import torch

from disagg.engine.tokenizer import bad_words_token_ids
from disagg.engine.logits_processors import apply_processors, banned_by
from disagg.engine.scheduler import ScheduledSeq
from disagg.types import InvalidRequest, SamplingParams
from hf_reference import hf_greedy_processed
from test_engine_tiny import engine, hf_greedy, run  # noqa: F401 - the fixture too
from test_engine_tiny import hf_tiny  # noqa: F401
from engine_runs import run_requests

PROMPT = "The quick brown fox jumps over the lazy dog. " * 2
N = 24


def seq(params, prompt=(), output=()):
    return ScheduledSeq("r", [1], 0, [0], True, False, params, len(output), len(prompt), None, tuple(prompt), tuple(output))


def test_penalties_on_one_row_exactly():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    out, failed = apply_processors(logits, [seq(params, prompt=(0, 1), output=(2, 2, 3))])
    # 0: prompt, positive -> /2; 1: prompt, negative -> *2; 2: twice in the output -> /2 - 2*0.5 - 0.25;
    # 3: once -> /2 - 0.5 - 0.25; 4: unseen.
    assert failed == {} and out.tolist() == [[1.0, -4.0, -0.75, -0.5, 3.0]]


def test_bias_allowed_ids_and_bad_words_exactly():
    logits = torch.zeros(2, 5)
    allowed = SamplingParams(allowed_token_ids=[1, 3], logit_bias={"3": 150.0, "1": -0.5})
    bad = SamplingParams(bad_words_token_ids=((4,), (2, 0)))
    out, failed = apply_processors(logits, [seq(allowed), seq(bad, output=(1, 2))])
    inf = float("-inf")
    assert failed == {}
    assert out.tolist() == [[inf, -0.5, inf, 100.0, inf], [inf, 0.0, 0.0, 0.0, inf]]  # bias clamped to 100
    assert logits.tolist() == torch.zeros(2, 5).tolist()  # the caller's logits are untouched


def test_banned_by_matches_the_output_tail():
    assert banned_by((7,), ())
    assert banned_by((5, 6, 7), (1, 5, 6))
    assert not banned_by((5, 6, 7), (6,))
    assert not banned_by((5, 6, 7), (5, 6, 1))


@pytest.mark.parametrize("fields, param, message", [
    ({"presence_penalty": 2.5}, "presence_penalty", "presence_penalty must be in [-2, 2], got 2.5"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty", "frequency_penalty must be in [-2, 2], got nan"),
    ({"repetition_penalty": 0.0}, "repetition_penalty", "repetition_penalty must be in (0, 2], got 0.0"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "logit_bias keys must be token ids, got 'x'"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "allowed_token_ids must be a non-empty list of non-negative integers"),
    ({"bad_words": [" "]}, "bad_words", "bad_words must be non-empty strings"),
])
def test_bad_values_are_typed_errors(fields, param, message):
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(**fields)
    assert (info.value.param, info.value.message) == (param, message)


def test_out_of_vocabulary_ids_are_refused_at_admission(tiny_loaded):
    core = engine(tiny_loaded)
    vocab = core.arch.vocab_size
    for fields, param in (({"logit_bias": {str(vocab): 1.0}}, "logit_bias"), ({"allowed_token_ids": [vocab]}, "allowed_token_ids")):
        with pytest.raises(InvalidRequest) as info:
            core.add_request("x", [1, 2], SamplingParams(**fields))
        assert info.value.param == param
        assert info.value.message == f"token id {vocab} in {param} is out of vocabulary (vocab_size={vocab})"


def hf_processed(hf, prompt_ids, params):
    return hf_greedy_processed(hf, prompt_ids, params, N)


def test_greedy_with_processors_equals_hf(tiny_loaded, hf_tiny):  # noqa: F811
    core = engine(tiny_loaded)
    prompt_ids = core.tokenizer.encode(PROMPT)
    plain = hf_greedy(hf_tiny, prompt_ids, N)
    word = two_token_word(core.tokenizer, plain)
    words = bad_words_token_ids(core.tokenizer, (word,))
    cases = [
        {"repetition_penalty": 1.8},
        {"repetition_penalty": 0.7},
        {"frequency_penalty": 1.5},
        {"presence_penalty": 2.0},
        {"presence_penalty": -0.5, "frequency_penalty": 1.0, "repetition_penalty": 1.3},
        {"logit_bias": {str(plain[0]): -100, str(plain[1]): 5.5}},
        {"allowed_token_ids": sorted(set(plain[4:12]))},
        {"bad_words": (word,)},
        {"bad_words": (word,), "logit_bias": {str(plain[2]): 3.0}, "repetition_penalty": 1.2, "frequency_penalty": 0.3},
    ]
    base = dict(max_tokens=N, temperature=0, ignore_eos=True)
    expected, got = [], []
    for fields in cases:
        params = SamplingParams(**base, **fields)
        ref_params = SamplingParams(**base, **fields, bad_words_token_ids=words if "bad_words" in fields else ())
        expected.append(hf_processed(hf_tiny, prompt_ids, ref_params))
        got.append(run(core, [prompt_ids], params)[0].outputs.token_ids)
    assert all(e != plain for e in expected)  # every case changes the tiny model's greedy output
    assert got == expected
    batched = [o.outputs.token_ids for o in run_mixed(core, prompt_ids, [SamplingParams(**base, **f) for f in cases])]
    assert batched == expected  # all cases in one batch, beside one another


def two_token_word(tokenizer, output):
    """A word the greedy output contains as two tokens that it tokenizes back to (a multi-token bad word)."""
    for i in range(1, len(output) - 1):
        text = tokenizer.decode(output[i:i + 2])
        if text.strip() == text and tokenizer.encode(text, add_special_tokens=False) == output[i:i + 2]:
            return text
    raise AssertionError("no two-token word in the output")


def run_mixed(core, prompt_ids, params_list):
    return run_requests(core, [(prompt_ids, params) for params in params_list])
