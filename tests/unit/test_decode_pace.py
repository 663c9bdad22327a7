"""The decode's pace (decode/pace.py): the most requests whose step the engine's own measured steps
put within the ITL objective, exact on steps of known cost."""

import pytest

from decode.pace import MIN_STEPS, StepPace
from disagg.engine.step_metrics import StepMetrics


def step(seqs: int, tokens: int = 0, fixed: float = 0.010, per_seq: float = 0.020, per_token: float = 0.0025):
    return StepMetrics(fixed + per_seq * seqs + per_token * tokens, tokens, seqs, 0, seqs, 0)


def test_the_pace_is_the_most_requests_within_the_objective():
    pace = StepPace(0.060)
    for i in range(40):  # 10 ms a step, 20 ms a request, 2.5 ms a prompt token
        pace.add(step(1 + i % 4, tokens=24 * (i % 3)))
    fixed, per_seq, per_token = pace.fit()
    assert (round(fixed, 6), round(per_seq, 6), round(per_token, 6)) == (0.010, 0.020, 0.0025)
    assert pace.cap(4) == 2  # 10 + 2 x 20 = 50 ms; 3 would take 70
    assert pace.cap(1) == 1
    assert StepPace(0.100).cap(8) == 8  # nothing seen yet: the decode's own limit
    generous = StepPace(1.0)
    for i in range(40):
        generous.add(step(1 + i % 4))
    assert generous.cap(8) == 8  # the limit bounds it


def test_until_enough_steps_and_without_decoding_requests_the_limit_holds():
    pace = StepPace(0.060)
    for _ in range(MIN_STEPS - 1):
        pace.add(step(4))
    assert pace.fit() is None and pace.cap(4) == 4
    for _ in range(50):
        pace.add(step(0, tokens=100))  # a prefill-only step says nothing of a request's pace
    assert pace.num_steps == MIN_STEPS - 1 and pace.cap(4) == 4


def test_one_batch_size_only_puts_a_step_on_its_requests_then_learns_from_the_smaller_batch():
    """Steps of 4 requests only (90 ms): no intercept can be told apart, so 22.5 ms a request and a pace
    of 2; steps of 2 (50 ms) then separate the 10 ms fixed cost and the pace stays 2."""
    pace = StepPace(0.060)
    for _ in range(MIN_STEPS):
        pace.add(step(4))
    assert pace.fit() == (0.0, pytest.approx(0.0225), pytest.approx(0.0))
    assert pace.cap(4) == 2
    for _ in range(MIN_STEPS):
        pace.add(step(2))
    fixed, per_seq, _ = pace.fit()
    assert (round(fixed, 6), round(per_seq, 6), pace.cap(4)) == (0.010, 0.020, 2)


def test_a_host_that_slows_down_lowers_the_pace_within_its_memory():
    pace = StepPace(0.060)
    for i in range(200):
        pace.add(step(1 + i % 4, per_seq=0.010))  # 10 + 10 n ms: 5 within 60
    assert pace.cap(8) == 5
    for i in range(300):
        pace.add(step(1 + i % 4, per_seq=0.025))  # the host at less than half the speed
    assert pace.cap(8) == 2
