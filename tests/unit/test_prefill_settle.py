"""A prefill drain's settle: it waits on leases until a worker's count says none are left."""

from __future__ import annotations

import asyncio

from disagg.dp.prefill_front import PrefillController


class Counts:
    """Stands in for the controller: the lease counts its workers give in turn (None: no answer)."""

    def __init__(self, counts):
        self.counts, self.timeouts_s = list(counts), []

    async def num_leases(self, timeout_s):
        self.timeouts_s.append(timeout_s)
        return self.counts.pop(0)


def test_an_unanswered_count_does_not_end_the_drain():
    counts = Counts([None, 2, None, 0])
    assert asyncio.run(PrefillController.settle(counts, timeout_s=5.0)) == 0
    assert counts.counts == [] and len(counts.timeouts_s) == 4


def test_at_the_deadline_the_last_answered_count_is_what_was_left():
    counts = Counts([3, None] + [None] * 100)
    assert asyncio.run(PrefillController.settle(counts, timeout_s=0.12)) == 3
    assert max(counts.timeouts_s) <= 0.12  # no count runs past the drain's deadline
