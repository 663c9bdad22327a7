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


def test_while_the_decodes_prefill_the_last_prefill_follows_the_prompt_load():
    """The one prefill computed 400 prompt tokens per second of its steps; the prompt load is every
    server's prompt tokens per second over that rate, the sums halving an interval. At most 1: the
    prefill becomes a decode (the decodes prefill every request then); with no prefill, past 0.9 a
    decode (1.8 for two): a decode becomes the prefill."""
    planner = Planner(ttft_slo_s=1.5, itl_slo_s=0.06)
    # 5 s: the prefill stepped 3 s for 1200 tokens (400/s), the decode prefilled 400 itself: (1600 / 5) / 400 = 0.8.
    light = (load(1, 30, 3.0, prefill_tokens=1200), load(1, 100, 4.0, prefill_tokens=400, decode_seqs=300))
    reason = ("prompt load 0.80 of one prefill server (400 tokens/s), at most 1: the prefill becomes a decode, "
              "every server prefills its own requests")
    assert planner.decide(*light, decodes_prefill=True) == Decision(
        Action.PREFILL_TO_DECODE, reason, 0.1, 0.04, 0, 2, False, 0.1, 0.04)
    assert planner.decide(*light, decodes_prefill=True).confirmed is True
    assert planner.prompt_load() == 0.8
    # Without decodes that prefill locally the one prefill stays, as before.
    assert Planner(1.5, 0.06).decide(*light).action is Action.HOLD
    # No prefill now: 2000 tokens in 5 s (1.0 of the rate) twice; then 4400 (2.2) three times.
    steady = (load(0, 0, 0.0), load(2, 200, 9.0, prefill_tokens=2000, decode_seqs=600))
    heavy = (load(0, 0, 0.0), load(2, 200, 9.6, prefill_tokens=4400, decode_seqs=600))
    decisions = [planner.decide(*loads, decodes_prefill=True) for loads in (steady, steady, heavy, heavy, heavy)]
    assert [(d.action, d.confirmed, d.num_prefill, d.num_decode) for d in decisions] == [
        (Action.HOLD, False, 0, 2), (Action.HOLD, False, 0, 2), (Action.HOLD, False, 0, 2),
        (Action.DECODE_TO_PREFILL, False, 1, 1), (Action.DECODE_TO_PREFILL, True, 1, 1)]
    assert [d.reason.partition(" of")[0] for d in decisions] == [
        "prompt load 0.91", "prompt load 0.96", "prompt load 1.60", "prompt load 1.90", "prompt load 2.05"]
    assert decisions[0].reason == ("prompt load 0.91 of one prefill server (400 tokens/s), ITL 45 ms, no prefill: "
                                   "every server prefills its own requests")
    assert decisions[3].reason == ("prompt load 1.90 of one prefill server (400 tokens/s), over 0.9 a server: a decode "
                                   "becomes the prefill")
    assert planner.prefill_rate == 400  # an interval without prefill steps keeps the rate


def test_no_rate_no_move_to_or_from_no_prefill():
    """Before 0.1 s of prefill steps were seen (the sums decay by 0.8 an interval) the usual rules hold;
    a move that would leave no decode, or two prefills, follows them too."""
    planner = Planner(ttft_slo_s=1.5, itl_slo_s=0.06)
    idle = (load(1, 5, 0.05, prefill_tokens=100), load(1, 40, 1.0))
    assert (planner.decide(*idle, decodes_prefill=True).reason, planner.prefill_rate) == (
        "TTFT 10 ms and ITL 25 ms against 1500 and 60 ms: no move pays", None)
    planner.decide(load(1, 6, 0.06, prefill_tokens=120), load(1, 40, 1.0), decodes_prefill=True)
    assert round(planner.prefill_rate, 6) == 2000.0  # (0.8 x 100 + 120) tokens / (0.8 x 0.05 + 0.06) s
    two = planner.decide(load(2, 10, 1.0, prefill_tokens=500), load(1, 40, 1.0), decodes_prefill=True)
    assert two.reason == "TTFT 100 ms and ITL 25 ms against 1500 and 60 ms: no move pays"
    lone = planner.decide(load(0, 0, 0.0), load(1, 40, 1.0, prefill_tokens=5000), decodes_prefill=True)
    assert (lone.action, lone.reason) == (Action.HOLD, "TTFT 0 ms and ITL 25 ms against 1500 and 60 ms: no move pays")


def test_requests_turned_away_with_a_slow_pace_bring_back_the_prefill_and_the_next_move_waits_twice_as_long():
    """With no prefill, 429s (admission turned requests away: at least 0.2 a second, twice the 0.1 under which the
    prefill may leave; their sums halving every 5 s) while the decodes' steps are over the ITL objective bring a
    prefill back however light the load; 429s at a pace within it do not (unified serving with the same limits
    turns as many away), nor does one 429 alone. The next move to no prefill waits until the 429s die down, then
    needs 4 proposals in a row, then 8; 6 calm intervals with no prefill make it 2 again."""
    planner = Planner(ttft_slo_s=1.5, itl_slo_s=0.06)
    light = (load(1, 30, 3.0, prefill_tokens=1200), load(1, 100, 4.0, prefill_tokens=400, decode_seqs=300))
    none = (load(0, 0, 0.0), load(2, 200, 14.0, prefill_tokens=400, decode_seqs=600))  # steps of 70 ms
    brisk = (load(0, 0, 0.0), load(2, 200, 9.0, prefill_tokens=400, decode_seqs=600))  # 45 ms

    def confirmed_after(loads, rejected: int = 0) -> int:
        for n in range(1, 20):
            decision = planner.decide(*loads, decodes_prefill=True, rejected=rejected)
            if decision.confirmed:
                return n
        raise AssertionError("never confirmed")

    assert (confirmed_after(light), planner.to_no_prefill_intervals) == (2, 2)
    held = [planner.decide(*brisk, decodes_prefill=True, rejected=3) for _ in range(3)]
    assert [d.action for d in held] == [Action.HOLD] * 3
    assert held[0].reason == ("prompt load 0.46 of one prefill server (400 tokens/s), ITL 45 ms, no prefill: every "
                              "server prefills its own requests")
    back = planner.decide(*none, decodes_prefill=True, rejected=2)
    assert (back.action, back.confirmed, back.num_prefill, back.num_decode) == (Action.DECODE_TO_PREFILL, False, 1, 1)
    assert back.reason == ("429s with no prefill (0.47 a second lately) and ITL 70 ms over its 60 ms objective "
                           "(prompt load 0.23 of one prefill server (400 tokens/s)): a decode becomes the prefill")
    assert planner.decide(*none, decodes_prefill=True, rejected=1).confirmed is True
    assert planner.to_no_prefill_intervals == 4
    first = planner.decide(*light, decodes_prefill=True)  # 429s lately (0.166 a second): the prefill is not idle
    assert (first.action, first.reason, round(planner.rejected_per_s(), 3)) == (
        Action.HOLD, "TTFT 100 ms and ITL 40 ms against 1500 and 60 ms: no move pays", 0.166)
    assert confirmed_after(light) == 4  # 4 in a row once the 429s have died down (0.08 a second)
    assert confirmed_after(none, rejected=3) == 2 and planner.to_no_prefill_intervals == 8
    assert confirmed_after(light) == 10  # 2 intervals while the 429s die down (0.22, 0.11 a second), then 8
    calm = [planner.decide(*none, decodes_prefill=True).action for _ in range(6)]
    assert calm == [Action.HOLD] * 6 and planner.to_no_prefill_intervals == 2
    once, rates = [], []
    for r in (1, 3, 0, 0):
        once.append(planner.decide(*none, decodes_prefill=True, rejected=r).action)
        rates.append(round(planner.rejected_per_s(), 3))
    assert once == [Action.HOLD, Action.DECODE_TO_PREFILL, Action.HOLD, Action.HOLD]
    assert rates == [0.1, 0.35, 0.175, 0.088]  # 0.2 a second reached once, then in the band: no return


def test_a_cluster_that_saw_no_prompt_yet_goes_without_prefill_at_once_and_slow_steps_lately_bring_it_back():
    """Before any prompt (a cluster just started) the one prefill becomes a decode at the first interval; with no
    prefill and its rate never measured, neither 429s at a pace within the ITL objective nor one document's step
    bring it back; steps over 1.5 times the ITL objective lately (the decodes' step sums since the prefill left,
    halving every 5 s) do, with no 429 (the next move to no prefill then needs 4 light intervals); without
    decodes that prefill locally it stays."""
    idle = (load(1, 0, 0.0), load(1, 0, 0.0))
    assert Planner(1.5, 0.06).decide(*idle).action is Action.HOLD
    planner = Planner(ttft_slo_s=1.5, itl_slo_s=0.06)
    assert planner.decide(*idle, decodes_prefill=True) == Decision(
        Action.PREFILL_TO_DECODE, "no prompt seen yet: the prefill becomes a decode, every server prefills its own "
        "requests", 0.0, 0.0, 0, 2, True, 0.0, 0.0)
    busy = (load(0, 0, 0.0), load(2, 100, 4.0, prefill_tokens=3000, decode_seqs=300))  # steps of 40 ms
    # A document: one server stepped 2.5 s once beside 60 steps of 40 ms, the other 125 of 40 ms.
    document = (load(0, 0, 0.0), load(2, 186, 9.9, prefill_tokens=3000, decode_seqs=300))
    slow = (load(0, 0, 0.0), load(2, 100, 25.0, prefill_tokens=3000, decode_seqs=300))  # 250 ms, every step
    held = [planner.decide(*loads, decodes_prefill=True, rejected=r)
            for loads, r in ((busy, 2), (busy, 0), (document, 0))]
    assert [(d.action, d.reason.partition(", no prefill")[0]) for d in held] == [
        (Action.HOLD, "its rate not measured yet, ITL 40 ms"), (Action.HOLD, "its rate not measured yet, ITL 40 ms"),
        (Action.HOLD, "its rate not measured yet, ITL 53 ms")]
    assert (planner.prefill_rate, round(planner.itl_lately(), 4)) == (None, 0.0476)  # (40/4 + 40/2 + 53.2) / 1.75
    back = [planner.decide(*slow, decodes_prefill=True) for _ in range(2)]
    assert [(d.action, d.confirmed, d.num_prefill) for d in back] == [
        (Action.DECODE_TO_PREFILL, False, 1), (Action.DECODE_TO_PREFILL, True, 1)]
    assert back[0].reason == ("ITL 156 ms lately with no prefill, over 1.5 times its 60 ms objective (its rate not "
                              "measured yet): a decode becomes the prefill")
    assert (planner.to_no_prefill_intervals, planner.leave_load()) == (4, 1.0)  # no load measured: the usual limit
    # The prefill back and idle again: prompts were seen, so no move at once (its rate is still unknown).
    assert planner.decide(*idle, decodes_prefill=True).action is Action.HOLD


def test_after_a_return_for_slow_steps_the_prefill_leaves_only_well_below_the_load_it_came_back_at():
    """The prefill (400 tokens a second) leaves at a prompt load of 0.6; with no prefill the load grows to 0.86 with
    steps of 80 ms, then 150 ms, and once the decodes' mean step since the prefill left (each interval's
    weighted by its seconds) is over 90 ms (1.5 x 60) twice the prefill comes back. It then stays at a load of
    0.8 (the usual limit is 1) and leaves again only at 0.7 of the load it came back at (0.60), after 4
    proposals in a row."""
    planner = Planner(ttft_slo_s=1.5, itl_slo_s=0.06)
    measured = (load(1, 30, 3.0, prefill_tokens=1200), load(1, 100, 3.0, decode_seqs=300))
    assert [planner.decide(*measured, decodes_prefill=True).confirmed for _ in range(2)] == [False, True]
    assert planner.itl_lately() is None  # a prefill served: its decodes' steps do not count
    moderate = (load(0, 0, 0.0), load(2, 124, 9.9, prefill_tokens=1600, decode_seqs=700))
    slow = (load(0, 0, 0.0), load(2, 66, 9.9, prefill_tokens=1800, decode_seqs=400))
    back = [planner.decide(*loads, decodes_prefill=True) for loads in (moderate, slow, slow)]
    assert [(d.action, d.confirmed) for d in back] == [
        (Action.HOLD, False), (Action.DECODE_TO_PREFILL, False), (Action.DECODE_TO_PREFILL, True)]
    assert back[0].reason == ("prompt load 0.71 of one prefill server (400 tokens/s), ITL 80 ms, no prefill: every "
                              "server prefills its own requests")
    assert back[1].reason == ("ITL 127 ms lately with no prefill, over 1.5 times its 60 ms objective (prompt "
                              "load 0.81 of one prefill server (400 tokens/s)): a decode becomes the prefill")
    assert round(planner.leave_load(), 4) == round(0.7 * 0.8580645, 4)  # the load at the return: 0.86

    def pd(prompt_tokens: float) -> tuple[RoleLoad, RoleLoad]:  # the prefill computes them at 400 a second
        return load(1, 40, prompt_tokens / 400, prefill_tokens=prompt_tokens), load(1, 150, 6.0, decode_seqs=1200)

    stays = [planner.decide(*pd(1600), decodes_prefill=True) for _ in range(6)]
    assert {d.reason for d in stays} == {"TTFT 100 ms and ITL 40 ms against 1500 and 60 ms: no move pays"}
    assert round(planner.prompt_load(), 3) == 0.801
    leaves = [planner.decide(*pd(1000), decodes_prefill=True) for _ in range(5)]
    assert [(d.action, d.confirmed) for d in leaves] == [(Action.HOLD, False)] + [
        (Action.PREFILL_TO_DECODE, False)] * 3 + [(Action.PREFILL_TO_DECODE, True)]
    assert leaves[1].reason == ("prompt load 0.58 of one prefill server (400 tokens/s), at most 0.6: the prefill "
                                "becomes a decode, every server prefills its own requests")


def test_the_429s_read_as_a_rate_whatever_the_interval():
    """Two 429s every 5 s read 0.4 a second with 5 s intervals and 0.8 then 0.33 with 2.5 s ones (the
    sums halve every 5 s of time, not every interval), so with no prefill and slow steps the return is
    proposed at every interval and confirmed at the second either way (a count an interval, halving an
    interval, read a pace of one every 5 s as 1, 0.5, 1.25 at 2.5 s)."""
    def slow(interval_s: float) -> tuple[RoleLoad, RoleLoad]:  # no prefill, decode steps of 80 ms
        steps = StepSums(interval_s * 12.5, interval_s, 100 * interval_s, 20 * interval_s)
        return RoleLoad(0, interval_s, StepSums()), RoleLoad(2, interval_s, steps)

    for interval_s, rejected in ((5.0, (2, 2)), (2.5, (2, 0))):
        planner = Planner(ttft_slo_s=1.5, itl_slo_s=0.06)
        decisions = [planner.decide(*slow(interval_s), decodes_prefill=True, rejected=r) for r in rejected]
        assert [(d.action, d.confirmed) for d in decisions] == [
            (Action.DECODE_TO_PREFILL, False), (Action.DECODE_TO_PREFILL, True)], interval_s
    assert decisions[1].reason == ("429s with no prefill (0.33 a second lately) and ITL 80 ms over its 60 ms "
                                   "objective (its rate not measured yet): a decode becomes the prefill")
