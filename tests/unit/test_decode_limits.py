"""decode/limits.py: how many requests a decode lets run at once for each kind of work, with and
without the pace, and the scheduler's limits that follow; exact values on steps of known cost."""

from decode.limits import DecodeLimits
from decode.pace import MIN_STEPS, StepPace
from disagg.engine.step_metrics import StepMetrics


def paced_to_two(limits: DecodeLimits | None = None) -> DecodeLimits:
    """A decode of 4 requests and 24 prompt tokens a step beside KV from a prefill, 8 sent whole, whose
    steps cost 10 ms plus 20 ms a request against a 60 ms objective: the pace allows 2."""
    limits = limits or DecodeLimits((4, 24), (8, 0), StepPace(0.060))
    for i in range(2 * MIN_STEPS):
        limits.add_step(StepMetrics(0.010 + 0.020 * (1 + i % 4), 0, 1 + i % 4, 0, 1 + i % 4, 0))
    return limits


def follow(limits: DecodeLimits, max_num_seqs: int, running: tuple[int, ...]) -> list[tuple[int, int]]:
    """The scheduler's limits step after step, from `max_num_seqs`, with these many requests running."""
    out = []
    for num_running in running:
        out.append(limits.scheduler_limits(num_running, max_num_seqs))
        max_num_seqs = out[-1][0]
    return out


def test_without_the_pace_each_kind_runs_under_its_limits_and_nothing_waits_for_a_slot():
    limits = DecodeLimits((4, 24), (8, 0), None)
    assert (limits.allowed(), limits.scheduler_limits(10, 4), limits.at_pace(10)) == (4, (4, 24), False)
    limits.sent_whole = True
    assert (limits.allowed(), limits.scheduler_limits(10, 4), limits.at_pace(10)) == (8, (8, 0), False)


def test_before_the_pace_knows_anything_kv_from_a_prefill_waits_at_the_decodes_own_limit():
    limits = DecodeLimits((4, 24), (8, 0), StepPace(0.060))
    assert limits.cap == 8  # the larger limit, for both kinds
    assert (limits.allowed(), limits.at_pace(3), limits.at_pace(4)) == (4, False, True)  # not 8: 4 run a step
    limits.sent_whole = True
    assert (limits.allowed(), limits.scheduler_limits(0, 4), limits.at_pace(7), limits.at_pace(8)) == (8, (8, 0), False, True)


def test_the_pace_lowers_both_kinds_and_never_the_scheduler_below_the_requests_running():
    limits = DecodeLimits((4, 24), (8, 0), StepPace(0.060))
    limits.sent_whole = True
    assert limits.scheduler_limits(5, 4) == (8, 0)  # the pace knows nothing yet: 5 of 8 run
    paced_to_two(limits)
    assert (limits.cap, limits.moves) == (2, 1)  # 8 until MIN_STEPS steps, then the fit's 2: one move
    assert follow(limits, 8, (5, 3, 1, 0)) == [(5, 0), (3, 0), (2, 0), (2, 0)]
    assert (limits.at_pace(1), limits.at_pace(2)) == (False, True)  # KV that lands meanwhile waits alike
    limits.sent_whole = False
    assert (limits.allowed(), limits.scheduler_limits(3, 2), limits.at_pace(1), limits.at_pace(2)) == (2, (4, 24), False, True)


def test_a_limit_that_falls_comes_down_as_the_requests_running_end():
    """Back from 8 requests sent whole to the decode's own 4 with 8 running: 8 stay scheduled, then 6
    as two end; KV landing past the limit meanwhile (9 running, no pace) does not raise it; then 4."""
    limits = DecodeLimits((4, 24), (8, 0), None)
    limits.sent_whole = True
    assert limits.scheduler_limits(8, 4) == (8, 0)
    limits.sent_whole = False
    assert follow(limits, 8, (8, 6, 9, 3)) == [(8, 24), (6, 24), (6, 24), (4, 24)]
    paced = paced_to_two()
    paced.sent_whole = True
    assert follow(paced, 4, (0, 5, 3, 4, 1)) == [(2, 0)] * 5
