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


def test_while_the_batch_barely_varies_the_pace_explores_one_request_at_a_time():
    """Steps of 4 requests only (90 ms, over the objective): no fit yet, one fewer (3); steps of 2
    (50 ms) then separate the 10 ms fixed cost and the fit says 2. A request alone for long (30 ms,
    within it) allows 2, so that a second one shows what a request costs; one never locks the pace."""
    pace = StepPace(0.060)
    for _ in range(MIN_STEPS):
        pace.add(step(4))
    assert pace.fit() is None and pace.cap(4) == 3
    for _ in range(MIN_STEPS):
        pace.add(step(2))
    fixed, per_seq, _ = pace.fit()
    assert (round(fixed, 6), round(per_seq, 6), pace.cap(4)) == (0.010, 0.020, 2)
    alone = StepPace(0.060)
    for _ in range(300):
        alone.add(step(1))
    assert alone.fit() is None and alone.cap(4) == 2
    documents = StepPace(0.060)  # 2 requests (50 ms) with a 1,000-token prompt every fourth step (2.55 s)
    for i in range(MIN_STEPS * 4):
        documents.add(step(2, tokens=1000 if i % 4 == 0 else 0))
    assert documents.fit() is None and documents.cap(4) == 3  # the batch alone keeps the objective: one more
    slow = StepPace(0.001)  # no step keeps it: one request at a time
    for _ in range(MIN_STEPS):
        slow.add(step(1))
    assert slow.cap(4) == 1


def test_a_cap_on_the_boundary_is_not_lost_to_rounding():
    pace = StepPace(0.030)
    for i in range(40):
        pace.add(step(1 + i % 4, fixed=0.010, per_seq=0.005))  # (30 - 10) / 5 = 4 exactly
    assert pace.cap(8) == 4


def test_a_host_that_slows_down_lowers_the_pace_within_its_memory():
    pace = StepPace(0.060)
    for i in range(200):
        pace.add(step(1 + i % 4, per_seq=0.010))  # 10 + 10 n ms: 5 within 60
    assert pace.cap(8) == 5
    for i in range(300):
        pace.add(step(1 + i % 4, per_seq=0.025))  # the host at less than half the speed
    assert pace.cap(8) == 2
