"""Sampling truncation with exact probabilities, and seeded sampling."""

import math

import torch

from disagg.engine.sampler import Sampler, top_logprobs, truncated_probs
from disagg.engine.scheduler import ScheduledSeq
from disagg.types import SamplingParams

LOGITS = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))


def probs(**kw) -> list[float]:
    return [round(p, 6) for p in truncated_probs(LOGITS.clone(), SamplingParams(temperature=1.0, **kw)).tolist()]


def test_top_k_top_p_min_p_and_temperature():
    assert probs() == [0.5, 0.25, 0.15, 0.1]
    assert probs(top_k=2) == [0.666667, 0.333333, 0.0, 0.0]
    assert probs(top_p=0.7) == [0.666667, 0.333333, 0.0, 0.0]  # 0.5 + 0.25 reaches 0.7
    assert probs(top_p=0.5) == [1.0, 0.0, 0.0, 0.0]
    assert probs(top_p=5e-324) == [1.0, 0.0, 0.0, 0.0]  # 0.0 in float32: the first token still stays
    assert probs(min_p=0.3) == [0.555556, 0.277778, 0.166667, 0.0]  # 0.1 < 0.3 * 0.5
    hot = truncated_probs(LOGITS.clone(), SamplingParams(temperature=2.0)).tolist()
    expected = [math.sqrt(p) / sum(math.sqrt(q) for q in (0.5, 0.25, 0.15, 0.1)) for p in (0.5, 0.25, 0.15, 0.1)]
    assert [round(p, 6) for p in hot] == [round(p, 6) for p in expected]


def test_top_logprobs_always_holds_the_chosen_token():
    lp = torch.log_softmax(LOGITS, -1)
    assert list(top_logprobs(lp, 2, 3)) == [0, 1, 3]
    assert list(top_logprobs(lp, 0, 2)) == [2]


def seq(rid, params):
    return ScheduledSeq(rid, [1], 0, [0], True, False, params, 0, 1, None)


def test_seeded_rows_repeat_and_greedy_rows_take_the_argmax():
    logits = torch.zeros(3, 50)
    logits[2, 17] = 5.0
    params = SamplingParams(temperature=1.0, seed=3)
    first = [t.token_id for t in Sampler(0).sample(logits, [seq("a", params), seq("b", params), seq("g", SamplingParams(temperature=0))], ())]
    again = [t.token_id for t in Sampler(99).sample(logits, [seq("a", params), seq("b", params), seq("g", SamplingParams(temperature=0))], ())]
    assert first == again and first[0] == first[1] and first[2] == 17


def test_min_tokens_bans_eos_and_stop_ids():
    logits = torch.zeros(1, 10)
    logits[0, 9] = 10.0
    logits[0, 8] = 9.0
    logits[0, 7] = 8.0
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[8])
    [tok] = Sampler(0).sample(logits, [seq("a", params)], eos_token_ids=(9,))
    assert tok.token_id == 7
