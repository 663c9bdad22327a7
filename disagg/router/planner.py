"""The role planner's policy: pure Python, no I/O, no clock (disagg/router/planning.py runs it).

Each interval it gets, per role, what the servers' engine steps did in that interval (their
`disagg_engine_step_*` counters from /metrics, as `StepSums` differences) and estimates:
- ITL: the mean wall time of a decode server's steps (each step gives every decoding request one
  token);
- TTFT: the mean wall time of a prefill server's steps, times the steps a new request waits behind
  the queue (1 + waiting requests per prefill server), the way a load planner reads queue and pace.
It proposes moving one server: a prefill to decode when ITL is over its objective while the
prefills are less than half busy; a decode to prefill when TTFT is over its objective while ITL
keeps half its margin; else it holds. A proposal is confirmed when it repeats `confirm_intervals`
times in a row (hysteresis); after a move the planner waits one interval.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

STEP_METRICS = {  # the /metrics series, summed over DP ranks -> StepSums field
    "disagg_engine_step_seconds_count": "num_steps",
    "disagg_engine_step_seconds_sum": "wall_s",
    "disagg_engine_step_prefill_tokens_sum": "prefill_tokens",
    "disagg_engine_step_decode_seqs_sum": "decode_seqs",
    "disagg_engine_step_waiting": "waiting",
}


@dataclass(frozen=True)
class StepSums:
    """A server's step counters (cumulative) and its queue after its last reported step."""

    num_steps: float = 0.0
    wall_s: float = 0.0
    prefill_tokens: float = 0.0
    decode_seqs: float = 0.0
    waiting: float = 0.0

    def since(self, earlier: StepSums) -> StepSums:
        """The counters' growth since `earlier` (a restarted server's counters start over: taken whole)."""
        if self.num_steps < earlier.num_steps:
            return self
        return StepSums(self.num_steps - earlier.num_steps, self.wall_s - earlier.wall_s,
                        self.prefill_tokens - earlier.prefill_tokens, self.decode_seqs - earlier.decode_seqs,
                        self.waiting)


def parse_step_sums(metrics_text: str) -> StepSums:
    """The STEP_METRICS series of a server's /metrics, summed over its DP ranks (absent: 0)."""
    values = dict.fromkeys(STEP_METRICS.values(), 0.0)
    for line in metrics_text.splitlines():
        name, _, rest = line.partition("{")
        field_name = STEP_METRICS.get(name)
        if field_name is not None and "} " in rest:
            try:
                values[field_name] += float(rest.rpartition("} ")[2])
            except ValueError:
                continue
    return StepSums(**values)


@dataclass(frozen=True)
class RoleLoad:
    """One role's servers over one interval."""

    num_servers: int
    interval_s: float
    steps: StepSums  # the servers' growth summed

    @property
    def step_s(self) -> float:
        """Mean wall time of a step (0 without steps)."""
        return self.steps.wall_s / self.steps.num_steps if self.steps.num_steps else 0.0

    @property
    def busy(self) -> float:
        """The share of the interval a server spent stepping, on average."""
        return self.steps.wall_s / (self.interval_s * self.num_servers) if self.num_servers else 0.0


class Action(str, enum.Enum):
    """What the planner proposes for the next interval."""

    HOLD = "hold"
    PREFILL_TO_DECODE = "prefill_to_decode"
    DECODE_TO_PREFILL = "decode_to_prefill"


@dataclass(frozen=True)
class Decision:
    """One interval's proposal, why, the estimates behind it and the role mix it leads to."""

    action: Action
    reason: str
    est_ttft_s: float
    est_itl_s: float
    num_prefill: int  # the role mix the decision leads to
    num_decode: int
    confirmed: bool = False  # the same proposal `confirm_intervals` times in a row: act on it


class Planner:
    """Decides once per interval; keeps only the streak of its last proposal (the hysteresis)."""

    def __init__(self, ttft_slo_s: float, itl_slo_s: float, confirm_intervals: int = 2):
        self.ttft_slo_s, self.itl_slo_s, self.confirm_intervals = ttft_slo_s, itl_slo_s, confirm_intervals
        self._streak: tuple[Action, int] = (Action.HOLD, 0)
        self._cooling = False

    def decide(self, prefill: RoleLoad, decode: RoleLoad) -> Decision:
        """This interval's proposal (see the module's docstring); `confirmed` when it should be acted on."""
        ttft = prefill.step_s * (1 + prefill.steps.waiting / max(prefill.num_servers, 1))
        itl = decode.step_s
        action, reason = self._propose(prefill, decode, ttft, itl)
        count = self._streak[1] + 1 if action is self._streak[0] else 1
        self._streak = (action, count)
        confirmed = action is not Action.HOLD and count >= self.confirm_intervals and not self._cooling
        self._cooling = confirmed
        if confirmed:
            self._streak = (Action.HOLD, 0)
        shift = {Action.HOLD: 0, Action.PREFILL_TO_DECODE: -1, Action.DECODE_TO_PREFILL: 1}[action]
        return Decision(action, reason, ttft, itl, prefill.num_servers + shift, decode.num_servers - shift, confirmed)

    def _propose(self, prefill: RoleLoad, decode: RoleLoad, ttft: float, itl: float) -> tuple[Action, str]:
        if itl > self.itl_slo_s and prefill.busy < 0.5 and prefill.num_servers > 1:
            return Action.PREFILL_TO_DECODE, (
                f"ITL {itl * 1e3:.0f} ms over its {self.itl_slo_s * 1e3:.0f} ms objective while the prefills are "
                f"{prefill.busy:.0%} busy")
        if ttft > self.ttft_slo_s and decode.num_servers > 1 and itl < self.itl_slo_s / 2:
            return Action.DECODE_TO_PREFILL, (
                f"TTFT {ttft * 1e3:.0f} ms over its {self.ttft_slo_s * 1e3:.0f} ms objective while ITL "
                f"{itl * 1e3:.0f} ms keeps half its margin")
        return Action.HOLD, (f"TTFT {ttft * 1e3:.0f} ms and ITL {itl * 1e3:.0f} ms against {self.ttft_slo_s * 1e3:.0f} "
                             f"and {self.itl_slo_s * 1e3:.0f} ms: no move pays")
