"""The role planner's policy (disagg/router/planner.py) on figures written out: its estimates, its
proposals with their reasons, and the hysteresis before it acts."""

from disagg.router.planner import Action, Decision, Planner, RoleLoad, StepFit, StepSums, parse_step_sums

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


def load(num_servers: int, num_steps: float, wall_s: float, waiting: float = 0.0, prefill_tokens: float = 0.0,
         decode_seqs: float = 0.0) -> RoleLoad:
    return RoleLoad(num_servers, 5.0, StepSums(num_steps, wall_s, prefill_tokens, decode_seqs, waiting))


def test_a_slow_decode_beside_idle_prefills_takes_a_prefill_after_two_intervals():
    planner = Planner(ttft_slo_s=1.5, itl_slo_s=0.06)
    prefill, decode = load(2, 10, 0.5), load(1, 40, 4.0)  # decode steps of 100 ms; prefills 5% busy
    first = planner.decide(prefill, decode)
    reason = "ITL 100 ms over its 60 ms objective; with one more decode: ITL 50 ms, TTFT 100 ms"
    assert first == Decision(Action.PREFILL_TO_DECODE, reason, 0.05, 0.1, 1, 2, False, 0.1, 0.05)
    assert planner.decide(prefill, decode) == Decision(Action.PREFILL_TO_DECODE, reason, 0.05, 0.1, 1, 2, True, 0.1,
                                                       0.05)
    assert planner.decide(prefill, decode).confirmed is False  # it starts counting again after a move


def test_a_queue_behind_the_prefills_takes_a_decode_while_itl_stays_within_its_objective():
    planner = Planner(ttft_slo_s=1.5, itl_slo_s=0.06)
    prefill, decode = load(1, 20, 4.0, waiting=9), load(2, 100, 2.0)  # 200 ms prefill steps, 9 waiting; ITL 20 ms
    decision = planner.decide(prefill, decode)
    assert (decision.action, decision.reason, decision.num_prefill, decision.num_decode) == (
        Action.DECODE_TO_PREFILL, "TTFT 2000 ms over its 1500 ms objective; with one more prefill: TTFT 1100 ms, "
        "ITL 40 ms", 2, 1)
    assert (round(decision.est_ttft_s, 6), round(decision.predicted_ttft_s, 6), decision.predicted_itl_s) == (
        2.0, 1.1, 0.04)  # the queue spreads over two full-stepping prefills; one decode runs both batches
    slow = Planner(ttft_slo_s=1.5, itl_slo_s=0.06).decide(prefill, load(2, 100, 4.0))  # ITL 40 ms: 80 ms on one
    assert (slow.action, slow.reason) == (Action.HOLD, "TTFT 2000 ms and ITL 40 ms against 1500 and 60 ms: no move pays")


def test_it_holds_within_the_objectives_and_when_a_move_would_empty_a_role():
    planner = Planner(ttft_slo_s=1.5, itl_slo_s=0.06)
    assert planner.decide(load(1, 10, 0.5), load(1, 40, 4.0)) == Decision(
        Action.HOLD, "ITL 100 ms over its 60 ms objective, but the one prefill server cannot leave its role",
        0.05, 0.1, 1, 1, False, 0.05, 0.1)
    assert planner.decide(load(1, 20, 4.0, waiting=9), load(1, 100, 2.0)) == Decision(
        Action.HOLD, "TTFT 2000 ms over its 1500 ms objective, but the one decode server cannot leave its role",
        2.0, 0.02, 1, 1, False, 2.0, 0.02)
    assert planner.decide(load(2, 10, 0.5), load(1, 100, 2.0)).reason == (
        "TTFT 50 ms and ITL 20 ms against 1500 and 60 ms: no move pays")
    busy = planner.decide(load(2, 100, 8.0, waiting=4), load(1, 40, 4.0))  # ITL over; fewer prefills: TTFT 480 ms
    assert (busy.action, busy.predicted_ttft_s) == (Action.PREFILL_TO_DECODE, 0.4)
    queued = Planner(ttft_slo_s=0.3, itl_slo_s=0.06).decide(load(2, 100, 8.0, waiting=4), load(1, 40, 4.0))
    assert (queued.action, queued.reason) == (
        Action.HOLD, "TTFT 240 ms and ITL 100 ms against 300 and 60 ms: no move pays")  # one prefill: TTFT 400 ms


def test_the_decode_fit_learns_a_fixed_cost_a_step_and_predicts_a_spread_batch_from_it():
    """Decode steps of 20 ms + 5 ms a request: at 16 requests a step 100 ms, spread over two decodes
    8 a step, 60 ms (not the 50 ms a proportional guess gives)."""
    fit = StepFit(decay=1.0)
    assert fit.scaled(16, 0.1, 0.5) == 0.05  # nothing fitted yet: in proportion
    fit.add(16, 0.1, 10)
    assert fit.scaled(16, 0.1, 0.5) == 0.05  # one level of work seen: in proportion
    fit.add(4, 0.04, 10)
    fit.add(8, 0.06, 10)
    assert round(fit.scaled(16, 0.1, 0.5), 9) == 0.06 and round(fit.scaled(8, 0.06, 0.25), 9) == 0.03
    assert fit.scaled(0, 0.07, 0.5) == 0.035  # no work reported: in proportion
    planner = Planner(ttft_slo_s=1.5, itl_slo_s=0.06)
    planner.decode_fit = fit
    decision = planner.decide(load(2, 10, 0.5), load(1, 40, 4.0, decode_seqs=640))  # 16 a step, 100 ms
    assert (decision.action, round(decision.predicted_itl_s, 9)) == (Action.PREFILL_TO_DECODE, 0.06)
