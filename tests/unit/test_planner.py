"""The role planner's policy (disagg/router/planner.py) on figures written out: its estimates, its
proposals with their reasons, and the hysteresis before it acts."""

from disagg.router.planner import Action, Decision, Planner, RoleLoad, StepSums, parse_step_sums

METRICS = """# HELP disagg_engine_step_seconds wall time
disagg_engine_step_seconds_count{dp_rank="0"} 10.0
disagg_engine_step_seconds_count{dp_rank="1"} 30.0
disagg_engine_step_seconds_sum{dp_rank="0"} 0.5
disagg_engine_step_seconds_sum{dp_rank="1"} 1.5
disagg_engine_step_prefill_tokens_sum{dp_rank="0"} 100.0
disagg_engine_step_decode_seqs_sum{dp_rank="1"} 64.0
disagg_engine_step_waiting{dp_rank="0"} 2.0
disagg_engine_step_seconds_bucket{dp_rank="0",le="0.1"} 10.0
disagg_requests_total{endpoint="/generate",status="200"} 7.0
"""


def test_a_servers_step_counters_are_summed_over_its_ranks():
    assert parse_step_sums(METRICS) == StepSums(40.0, 2.0, 100.0, 64.0, 2.0)
    assert parse_step_sums("") == StepSums()
    later = StepSums(50.0, 2.5, 180.0, 64.0, 0.0)
    assert later.since(parse_step_sums(METRICS)) == StepSums(10.0, 0.5, 80.0, 0.0, 0.0)
    assert StepSums(3.0, 0.1).since(later) == StepSums(3.0, 0.1)  # restarted: its counters start over


def load(num_servers: int, num_steps: float, wall_s: float, waiting: float = 0.0) -> RoleLoad:
    return RoleLoad(num_servers, 5.0, StepSums(num_steps, wall_s, waiting=waiting))


def test_a_slow_decode_beside_idle_prefills_takes_a_prefill_after_two_intervals():
    planner = Planner(ttft_slo_s=1.5, itl_slo_s=0.06)
    prefill, decode = load(2, 10, 0.5), load(1, 40, 4.0)  # decode steps of 100 ms; prefills 5% busy
    first = planner.decide(prefill, decode)
    reason = "ITL 100 ms over its 60 ms objective while the prefills are 5% busy"
    assert first == Decision(Action.PREFILL_TO_DECODE, reason, 0.05, 0.1, 1, 2, confirmed=False)
    assert planner.decide(prefill, decode) == Decision(Action.PREFILL_TO_DECODE, reason, 0.05, 0.1, 1, 2, confirmed=True)
    assert planner.decide(prefill, decode).confirmed is False  # it starts counting again after a move


def test_a_queue_behind_the_prefills_takes_a_decode_while_itl_has_margin():
    planner = Planner(ttft_slo_s=1.5, itl_slo_s=0.06)
    prefill, decode = load(1, 20, 4.0, waiting=9), load(2, 100, 2.0)  # 200 ms prefill steps, 9 waiting; ITL 20 ms
    decision = planner.decide(prefill, decode)
    assert (decision.action, decision.reason, decision.num_prefill, decision.num_decode) == (
        Action.DECODE_TO_PREFILL, "TTFT 2000 ms over its 1500 ms objective while ITL 20 ms keeps half its margin", 2, 1)
    assert round(decision.est_ttft_s, 6) == 2.0


def test_it_holds_within_the_objectives_and_when_a_move_would_empty_a_role():
    planner = Planner(ttft_slo_s=1.5, itl_slo_s=0.06)
    assert planner.decide(load(1, 10, 0.5), load(1, 40, 4.0)) == Decision(
        Action.HOLD, "TTFT 50 ms and ITL 100 ms against 1500 and 60 ms: no move pays", 0.05, 0.1, 1, 1)
    hold = planner.decide(load(2, 10, 0.5), load(2, 100, 2.0))
    assert (hold.action, hold.confirmed) == (Action.HOLD, False)
    busy = planner.decide(load(2, 100, 6.0), load(1, 40, 4.0))  # ITL over, but the prefills are 60% busy
    assert busy.action is Action.HOLD
