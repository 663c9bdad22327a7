"""--ttft-objective-ms: a server refuses new requests while the first tokens it gave lately came past the
objective and others still wait (api/admission.py's FirstTokenWaits and ttft_overload), clock passed in."""

from disagg.api.admission import MAX_WAITS, MIN_WAITS, WAIT_WINDOW_S, FirstTokenWaits, Overload, ttft_overload


def waits_of(*spans, waiting=()):
    """A FirstTokenWaits where each (dispatched, answered) span got its first output, and each id in
    `waiting` was dispatched at time 0 and waits still."""
    waits = FirstTokenWaits()
    for i, (dispatched, answered) in enumerate(spans):
        waits.dispatched(f"a{i}", dispatched)
        waits.answered(f"a{i}", answered)
    for rid in waiting:
        waits.dispatched(rid, 0.0)
    return waits


def test_the_window_and_the_least_count_are_what_the_help_says():
    assert (WAIT_WINDOW_S, MAX_WAITS, MIN_WAITS) == (10.0, 5, 3)


def test_every_latest_wait_past_the_objective_with_one_waiting_is_refused():
    waits = waits_of((0.0, 2.0), (0.5, 3.0), (1.0, 4.0), waiting=("w",))  # waited 2.0, 2.5 and 3.0 s
    assert ttft_overload(waits, 1500.0, now=4.0) == Overload(
        "the server's requests waited at least 2000 ms for their first token lately (the last 3 answered in 10 s; "
        "1 waiting now, the longest for 4000 ms), past its objective (--ttft-objective-ms 1500): retry later",
        "ttft_over_objective")
    assert ttft_overload(waits, 2000.0, now=4.0) is None  # at the objective is within it
    assert ttft_overload(waits, 0.0, now=4.0) is None  # off


def test_nothing_waiting_or_too_few_answered_lately_is_taken():
    assert ttft_overload(waits_of((0.0, 2.0), (0.5, 3.0), (1.0, 4.0)), 1500.0, now=4.0) is None  # no queue now
    assert ttft_overload(waits_of((0.5, 3.0), (1.0, 4.0), waiting=("w",)), 1500.0, now=4.0) is None  # 2 of 3
    waits = waits_of((0.0, 2.0), (0.5, 3.0), (1.0, 4.0), waiting=("w",))
    assert waits.recent_waits_s(now=4.0) == [2.0, 2.5, 3.0]
    assert waits.recent_waits_s(now=12.01) == [2.5, 3.0]  # the first answer is now more than 10 s old
    assert ttft_overload(waits, 1500.0, now=12.01) is None


def test_only_the_latest_five_answers_count_and_one_quick_keeps_the_door_open():
    """Two quick answers, then five slow ones: the quick ones no longer count, though within 10 s; a burst
    at a light load leaves one quick answer among the five, and the next request is taken."""
    waits = waits_of((0.0, 0.5), (0.0, 0.5), *[(0.0, 2.0)] * 5, waiting=("w",))
    assert waits.recent_waits_s(now=4.0) == [2.0] * 5
    assert ttft_overload(waits, 1500.0, now=4.0).message.startswith(
        "the server's requests waited at least 2000 ms for their first token lately (the last 5 answered in 10 s;")
    waits = waits_of(*[(0.0, 2.0)] * 4, (1.5, 2.0), waiting=("w",))
    assert (min(waits.recent_waits_s(now=4.0)), ttft_overload(waits, 1500.0, now=4.0)) == (0.5, None)


def test_a_request_counts_once_and_leaves_the_queue_when_it_ends():
    waits = waits_of((0.0, 2.0), (0.0, 2.0), waiting=("w", "x"))
    waits.answered("a0", 3.0)  # a later output of the same request: not a second first token
    waits.answered("w", 2.5)
    waits.answered("w", 2.9)
    assert (waits.recent_waits_s(now=3.0), waits.num_waiting) == ([2.0, 2.0, 2.5], 1)
    assert ttft_overload(waits, 1500.0, now=3.0).code == "ttft_over_objective"
    waits.dropped("x")  # ended (finished, failed or aborted) without an output
    waits.dropped("x")
    assert (waits.num_waiting, ttft_overload(waits, 1500.0, now=3.0)) == (0, None)


def test_a_queue_that_cleared_does_not_hold_the_door_shut():
    """Slow answers lately, but the one request waiting was taken 0.7 s ago: under half of a 1.5 s objective,
    so no queue stands now; at 0.75 s it is half, and the next is refused."""
    waits = waits_of((0.0, 3.0), (0.0, 3.0), (0.0, 3.0))
    waits.dispatched("new", 3.3)
    assert (waits.longest_wait_s(now=4.0), ttft_overload(waits, 1500.0, now=4.0)) == (0.7000000000000002, None)
    assert ttft_overload(waits, 1500.0, now=4.05).message == (
        "the server's requests waited at least 3000 ms for their first token lately (the last 3 answered in 10 s; "
        "1 waiting now, the longest for 750 ms), past its objective (--ttft-objective-ms 1500): retry later")
    assert FirstTokenWaits().longest_wait_s(now=5.0) == 0.0
