"""How many requests a decode lets run at once, and its scheduler's limits. Pure.

Two kinds of work come to a decode: KV from a prefill (or a short rest it prefills beside it), under
the decode's own limits, which keep its decoding requests' pace; and requests sent whole while no
prefill serves, under a unified server's (`--whole-max-num-seqs`, no per-step prompt cap). The pace
(`--itl-objective-ms`, decode/pace.py), where set, lowers either to the most requests its fit puts
within the objective. A request whose KV landed joins the running batch at once when admitted, so the
role holds it before admission (`at_pace`); a request sent whole starts in the scheduler, so there
the pace lowers the scheduler's own limit. The scheduler runs at most its limit of its running
requests a step, so a limit that falls (the pace's, or the decode's own after requests sent whole)
never falls below the requests already running: it comes down as they end, and only new starts wait.
"""

from __future__ import annotations

from decode.pace import StepPace
from disagg.engine.step_metrics import StepMetrics


class DecodeLimits:
    def __init__(self, own: tuple[int, int], whole: tuple[int, int], pace: StepPace | None):
        """`own`, `whole`: (max_num_seqs, max_prefill_tokens_per_step) for each kind of work."""
        self.own, self.whole, self.pace = own, whole, pace
        self.sent_whole = False  # the requests now coming are sent whole
        self.cap = max(own[0], whole[0])  # the pace's, after the last step it saw (up to the larger limit)
        self.moves = 0  # the cap's moves since the role last reported them

    def allowed(self) -> int:
        """The most requests that may run at once for the kind of work now coming."""
        limit = (self.whole if self.sent_whole else self.own)[0]
        return limit if self.pace is None else min(limit, self.cap)

    def scheduler_limits(self, num_running: int, max_num_seqs: int) -> tuple[int, int]:
        """(max_num_seqs, max_prefill_tokens_per_step) for the scheduler, whose limit is `max_num_seqs` now,
        with `num_running` running: the limit of the work now coming (for requests sent whole, the
        pace's), or as many as run now while more run than that, but never more than its limit now
        (landed KV past the limit does not raise it)."""
        limits = self.whole if self.sent_whole else self.own
        floor = self.allowed() if self.sent_whole else limits[0]
        return max(floor, min(max_num_seqs, num_running)), limits[1]

    def at_pace(self, num_running: int) -> bool:
        """A request whose KV landed waits for a slot before its first token (only with the pace on)."""
        return self.pace is not None and num_running >= self.allowed()

    def add_step(self, step: StepMetrics) -> None:
        """A step the engine ran: the pace learns it and its cap follows (the pace must be on)."""
        self.pace.add(step)
        cap = self.pace.cap(max(self.own[0], self.whole[0]))
        if cap != self.cap:
            self.cap, self.moves = cap, self.moves + 1
