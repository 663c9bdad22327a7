"""The role planner's policy: pure Python, no I/O, no clock (disagg/router/planning.py runs it).

Each interval it gets, per role, what the servers' engine steps did in that interval (their
`disagg_engine_step_*` counters from /metrics, as `StepSums` differences) and estimates:
- ITL: the mean wall time of a decode server's steps (each step gives every decoding request one
  token);
- TTFT: the mean wall time of a prefill server's steps, times the steps a new request waits behind
  the queue (1 + waiting requests per prefill server), the way a load planner reads queue and pace.
Per role it fits a step's wall time to its work online (`StepFit`, least squares over the intervals,
older ones decaying; Dynamo's load planner fits its interpolators the same way): a decode step to its
decoding requests, a prefill step to its prompt tokens. From the fits it predicts both estimates for
the role mix a move leads to (the same work spread over one server more or fewer). It proposes
moving a prefill to decode when ITL is over its objective and the move is predicted to lower ITL
while TTFT stays within its objective; a decode to prefill when TTFT is over its objective and ITL
is predicted to stay within its objective; else it holds. A proposal is confirmed when it repeats
`confirm_intervals` times in a row (hysteresis); after a move the planner waits one interval.

While the decodes prefill locally (`decodes_prefill`: our router sends them whole prompts when no
prefill serves) the last prefill may leave its role too. Before any prompt was seen (a cluster just
started) it leaves at the first interval: below capacity every server serves best prefilling its own
requests, and a load past capacity shows itself in 429s at a slow pace. Later the load decides: the
prompt tokens computed per second, by every server, over what one prefill server computes per second
of its steps (both over the intervals seen, older ones decaying: the load's sums by half every 5 s,
whatever the interval, the rate's by 0.8 an interval). At most `light_load` (the prefill is not
saturated: its core serves more running requests end to end) while no requests are turned away (a
prefill whose cluster answers 429s is not idle for want of work), the one prefill becomes a decode and
every server prefills its own requests. With no prefill, a decode becomes the prefill again once the
prompts the decodes prefill stall the requests decoding beside them: requests turned away (the router's
429s a second over the load's seconds, at least RETURN_REJECTED_PER_S: two in the last 10 s, twice the
rate that stops a move to no prefill, so a load between the two stays where it is) while the decodes'
mean step is over the ITL objective (429s alone do not: unified serving with the same admission limits
turns as many away below capacity); the decodes' mean step lately (each interval's since the prefill
left, weighted by its seconds, halving as the load's sums) over RETURN_ITL_FACTOR times the ITL
objective, most requests missing their TPOT objective (one interval's mean does not: one document
prefilled in a step doubles it at a load no-prefill serves best); or a prompt load past `heavy_load` a
decode. Past capacity P/D keeps what it admits within the objectives. Each such return doubles the
proposals in a row the next move to no prefill needs (up to 16 intervals; reset after 6 calm ones with
no prefill), and a return for slow steps lowers the load the prefill may leave at to LEAVE_LOAD_FRACTION
of the load it came back at, so a load past capacity stays with P/D instead of flapping.
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


# The moves to and from no prefill (see the module's docstring), in prompt tokens per second over one
# prefill server's rate: up to LIGHT_LOAD (the prefill is not saturated) its core serves more running
# whole requests; past HEAVY_LOAD the decodes' steps fill with prompts. docs/benchmarks.md ("Roles that
# follow the load") has the figures.
LIGHT_LOAD = 1.0
HEAVY_LOAD = 0.9  # a server: with no prefill, d decodes prefill up to d times one prefill's rate
MAX_TO_NO_PREFILL_INTERVALS = 16  # a move to no prefill after repeated overloads waits at most this many intervals
CALM_INTERVALS = 6  # with no prefill and no move this long, the next move to no prefill needs confirm_intervals again
LOAD_HALF_LIFE_S = 5.0  # the prompt load's and the 429s' sums halve in this time: a document's burst weighs ~10 s
# 429s a second lately (their sums over the seconds'): from LEAVE a prefill stays (its cluster turns requests away);
# from RETURN (with slow steps) it comes back. The band between them keeps a load near capacity where it is.
LEAVE_REJECTED_PER_S = 0.1
RETURN_REJECTED_PER_S = 0.2
# With no prefill, the decodes' mean step lately (itl_lately: each interval's weighted by its seconds) past
# this many times the ITL objective brings the prefill back on its own: most requests miss their TPOT
# objective then, while one document's step lifts it for an interval only. After such a return the prefill
# leaves again only at LEAVE_LOAD_FRACTION of the prompt load it came back at (a band between the two, sized
# by the machine itself).
RETURN_ITL_FACTOR = 1.5
LEAVE_LOAD_FRACTION = 0.7
MIN_RATE_WALL_S = 0.1  # a prefill's rate is known once its steps ran this long (decaying sums)


class StepFit:
    """A step's wall time as a line in its work (decoding requests, or prompt tokens), fitted online:
    each interval adds one point (its mean work and mean wall time a step) weighted by its steps, the
    sums decaying by `decay` an interval. With one level of work seen (or none reported) it scales the
    mean time in proportion to the work."""

    def __init__(self, decay: float = 0.8):
        self.decay = decay
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def add(self, work: float, step_s: float, weight: float) -> None:
        if weight <= 0:
            return
        d = self.decay
        self.w, self.sx, self.sy = d * self.w + weight, d * self.sx + weight * work, d * self.sy + weight * step_s
        self.sxx, self.sxy = d * self.sxx + weight * work * work, d * self.sxy + weight * work * step_s

    def scaled(self, work: float, step_s: float, factor: float) -> float:
        """The step time when a step that did `work` in `step_s` does `factor` times that work: on the
        fitted line, or in proportion while the fit has seen one level of work (or none reported)."""
        if self.w <= 0 or work <= 0:
            return step_s * factor
        mean_x, mean_y = self.sx / self.w, self.sy / self.w
        var = self.sxx / self.w - mean_x * mean_x
        if var <= (0.05 * mean_x) ** 2:
            return step_s * factor
        slope = max((self.sxy / self.w - mean_x * mean_y) / var, 0.0)
        intercept = max(mean_y - slope * mean_x, 0.0)
        return intercept + slope * work * factor


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
    def work(self) -> float:
        """Mean work of a step: its decoding requests on a decode, its prompt tokens on a prefill."""
        total = self.steps.decode_seqs if self.steps.decode_seqs else self.steps.prefill_tokens
        return total / self.steps.num_steps if self.steps.num_steps else 0.0

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
    predicted_ttft_s: float = 0.0  # the fits' estimates for the role mix the decision leads to
    predicted_itl_s: float = 0.0


class Planner:
    """Decides once per interval; keeps only the streak of its last proposal (the hysteresis)."""

    def __init__(self, ttft_slo_s: float, itl_slo_s: float, confirm_intervals: int = 2, light_load: float = LIGHT_LOAD,
                 heavy_load: float = HEAVY_LOAD):
        self.ttft_slo_s, self.itl_slo_s, self.confirm_intervals = ttft_slo_s, itl_slo_s, confirm_intervals
        self.light_load, self.heavy_load = light_load, heavy_load
        self.prefill_fit, self.decode_fit = StepFit(), StepFit()
        self._rate_sums = (0.0, 0.0)  # (prompt tokens, seconds) of the prefills' steps, decaying as the fits
        self._load_sums = (0.0, 0.0)  # (prompt tokens of every server, seconds of the intervals), decaying
        self._rejected_sum = 0.0  # the router's 429s, decaying as the load's sums (over their seconds: a rate)
        self._itl_sums = (0.0, 0.0)  # (mean step x seconds, seconds) of the intervals with no prefill, decaying
        self._return_load: float | None = None  # the prompt load at the last return for slow steps
        self._prompt_seen = False  # some interval had work: prompt tokens, decoding requests, a queue or a 429
        self._streak: tuple[Action, int] = (Action.HOLD, 0)
        self._cooling = False
        self.to_no_prefill_intervals = confirm_intervals  # proposals in a row a move to no prefill needs now
        self._calm = 0  # intervals in a row with no prefill and no move

    def decide(self, prefill: RoleLoad, decode: RoleLoad, decodes_prefill: bool = False, rejected: int = 0) -> Decision:
        """This interval's proposal (see the module's docstring); `confirmed` when it should be acted on.
        `decodes_prefill`: with no prefill, the decodes would prefill every request themselves;
        `rejected`: the requests the cluster answered 429 (admission) in the interval."""
        self.prefill_fit.add(prefill.work, prefill.step_s, prefill.steps.num_steps)
        self.decode_fit.add(decode.work, decode.step_s, decode.steps.num_steps)
        decay, interval_s = self.prefill_fit.decay, prefill.interval_s or decode.interval_s
        halving = 0.5 ** (interval_s / LOAD_HALF_LIFE_S)  # by time, so that any interval reads the same load
        self._rejected_sum = halving * self._rejected_sum + rejected
        self._prompt_seen = self._prompt_seen or any((prefill.steps.prefill_tokens, prefill.steps.waiting, rejected,
                                                      decode.steps.prefill_tokens, decode.steps.decode_seqs))
        self._load_sums = (halving * self._load_sums[0] + prefill.steps.prefill_tokens + decode.steps.prefill_tokens,
                           halving * self._load_sums[1] + interval_s)
        # With no prefill only (the decodes' steps beside a prefill say nothing of prefilling locally), each
        # interval's mean step weighted by its seconds: a request decodes through time, not through steps.
        stepped_s = interval_s if decode.steps.num_steps else 0.0
        self._itl_sums = ((halving * self._itl_sums[0] + stepped_s * decode.step_s,
                           halving * self._itl_sums[1] + stepped_s) if prefill.num_servers == 0 else (0.0, 0.0))
        if prefill.steps.prefill_tokens > 0:
            self._rate_sums = (decay * self._rate_sums[0] + prefill.steps.prefill_tokens,
                               decay * self._rate_sums[1] + prefill.steps.wall_s)
        ttft = prefill.step_s * (1 + prefill.steps.waiting / max(prefill.num_servers, 1))
        itl = decode.step_s
        roles = self._propose_roles(prefill, decode, ttft, itl) if decodes_prefill else None
        action, reason, after = roles or self._propose(prefill, decode, ttft, itl)
        count = self._streak[1] + 1 if action is self._streak[0] else 1
        self._streak = (action, count)
        to_none = roles is not None and action is Action.PREFILL_TO_DECODE
        # To no prefill it may have to wait longer; before any prompt it goes at once (nothing to confirm).
        needed = (self.to_no_prefill_intervals if self._prompt_seen else 1) if to_none else self.confirm_intervals
        confirmed = action is not Action.HOLD and count >= needed and not self._cooling
        self._cooling = confirmed
        if confirmed:
            self._streak = (Action.HOLD, 0)
        self._back_off(roles is not None, action, confirmed, prefill.num_servers)
        shift = {Action.HOLD: 0, Action.PREFILL_TO_DECODE: -1, Action.DECODE_TO_PREFILL: 1}[action]
        return Decision(action, reason, ttft, itl, prefill.num_servers + shift, decode.num_servers - shift, confirmed,
                        *after)

    def predict(self, prefill: RoleLoad, decode: RoleLoad, shift: int) -> tuple[float, float]:
        """(TTFT, ITL) predicted with `shift` more prefill servers (and as many fewer decodes): each
        role's work and queue spread over its servers then (prefills with a queue run full steps
        still: only the queue spreads)."""
        p, d = prefill.num_servers, decode.num_servers
        if p + shift < 1 or d - shift < 1:
            return float("inf"), float("inf")
        saturated = prefill.steps.waiting > 0
        step_p = (self.prefill_fit.scaled(prefill.work, prefill.step_s, p / (p + shift)) if shift and not saturated
                  else prefill.step_s)
        ttft = step_p * (1 + prefill.steps.waiting / (p + shift))
        itl = self.decode_fit.scaled(decode.work, decode.step_s, d / (d - shift)) if shift else decode.step_s
        return ttft, itl

    def _back_off(self, by_roles: bool, action: Action, confirmed: bool, num_prefill: int) -> None:
        """A prefill brought back (requests turned away with none) doubles the intervals the next move
        to no prefill must be proposed in a row, up to MAX_TO_NO_PREFILL_INTERVALS, so a load past
        capacity does not flap between the two; CALM_INTERVALS with no prefill and no move reset them."""
        if by_roles and confirmed and action is Action.DECODE_TO_PREFILL:
            if self._steps_slow():  # the return was for slow steps: that rule comes first
                self._return_load = self.prompt_load()
            self.to_no_prefill_intervals = min(2 * self.to_no_prefill_intervals, MAX_TO_NO_PREFILL_INTERVALS)
            self._calm = 0
        elif num_prefill == 0 and action is Action.HOLD:
            self._calm += 1
            if self._calm >= CALM_INTERVALS:
                self.to_no_prefill_intervals = self.confirm_intervals
        else:
            self._calm = 0

    @property
    def prefill_rate(self) -> float | None:
        """Prompt tokens a prefill server computes per second of its steps, over the intervals it ran
        (older ones decaying); None before MIN_RATE_WALL_S of its steps were seen."""
        tokens, wall_s = self._rate_sums
        return tokens / wall_s if wall_s >= MIN_RATE_WALL_S else None

    def prompt_load(self) -> float | None:
        """Prompt tokens computed per second by every server over one prefill server's rate, over the
        intervals seen (older ones halving every LOAD_HALF_LIFE_S, so a document's burst weighs ~10 s);
        None before a rate was measured."""
        tokens, seconds = self._load_sums
        if not self.prefill_rate or seconds <= 0:
            return None
        return tokens / seconds / self.prefill_rate

    def itl_lately(self) -> float | None:
        """The decodes' mean step over the intervals since the last prefill left, each weighted by its
        seconds (older ones halving as the load's sums); None while a prefill serves or before a decode
        stepped."""
        weighted_s, seconds = self._itl_sums
        return weighted_s / seconds if seconds > 0 else None

    def _steps_slow(self) -> bool:
        """With no prefill, the decodes' mean step lately is over RETURN_ITL_FACTOR times the ITL objective."""
        lately = self.itl_lately()
        return lately is not None and lately > RETURN_ITL_FACTOR * self.itl_slo_s

    def leave_load(self) -> float:
        """The prompt load up to which the one prefill may leave: `light_load`, or after a return from no
        prefill for slow steps LEAVE_LOAD_FRACTION of the load it came back at, if lower."""
        if self._return_load is None:
            return self.light_load
        return min(self.light_load, LEAVE_LOAD_FRACTION * self._return_load)

    def rejected_per_s(self) -> float:
        """The router's 429s a second over the intervals seen (older ones decaying as the load's sums)."""
        seconds = self._load_sums[1]
        return self._rejected_sum / seconds if seconds > 0 else 0.0

    def _propose_roles(self, prefill: RoleLoad, decode: RoleLoad, ttft: float,
                       itl: float) -> tuple[Action, str, tuple[float, float]] | None:
        """The moves to and from no prefill at all (the decodes prefill locally); None: the usual rules."""
        p, d = prefill.num_servers, decode.num_servers
        if p > 1 or (p == 0 and d < 2) or (p == 1 and d < 1):
            return None
        load = self.prompt_load()
        said = ("its rate not measured yet" if load is None else
                f"prompt load {load:.2f} of one prefill server ({self.prefill_rate:.0f} tokens/s)")
        if p == 1 and not self._prompt_seen:
            return Action.PREFILL_TO_DECODE, ("no prompt seen yet: the prefill becomes a decode, every server prefills "
                                              "its own requests"), (ttft, itl)
        if p == 1 and load is not None and load <= self.leave_load() and self.rejected_per_s() < LEAVE_REJECTED_PER_S:
            return Action.PREFILL_TO_DECODE, (f"{said}, at most {self.leave_load():.2g}: the prefill becomes a decode, "
                                              "every server prefills its own requests"), (ttft, itl)
        if p != 0:
            return None
        pace, rejected_per_s = f"ITL {itl * 1e3:.0f} ms", self.rejected_per_s()
        if self._steps_slow():
            return Action.DECODE_TO_PREFILL, (f"ITL {self.itl_lately() * 1e3:.0f} ms lately with no prefill, over "
                                              f"{RETURN_ITL_FACTOR:g} times its {self.itl_slo_s * 1e3:.0f} ms "
                                              f"objective ({said}): a decode becomes the prefill"), (ttft, itl)
        if rejected_per_s >= RETURN_REJECTED_PER_S and itl > self.itl_slo_s:
            return Action.DECODE_TO_PREFILL, (f"429s with no prefill ({rejected_per_s:.2f} a second lately) and "
                                              f"{pace} over its {self.itl_slo_s * 1e3:.0f} ms objective ({said}): a "
                                              "decode becomes the prefill"), (ttft, itl)
        if load is not None and load > self.heavy_load * d:
            return Action.DECODE_TO_PREFILL, (f"{said}, over {self.heavy_load:g} a server: a decode becomes the "
                                              "prefill"), (ttft, itl)
        return Action.HOLD, f"{said}, {pace}, no prefill: every server prefills its own requests", (ttft, itl)

    def _propose(self, prefill: RoleLoad, decode: RoleLoad, ttft: float,
                 itl: float) -> tuple[Action, str, tuple[float, float]]:
        to_decode, to_prefill = self.predict(prefill, decode, -1), self.predict(prefill, decode, 1)
        if itl > self.itl_slo_s:
            why = f"ITL {itl * 1e3:.0f} ms over its {self.itl_slo_s * 1e3:.0f} ms objective"
            if prefill.num_servers < 2:
                return Action.HOLD, f"{why}, but the one prefill server cannot leave its role", (ttft, itl)
            if to_decode[1] < itl and to_decode[0] <= self.ttft_slo_s:
                return Action.PREFILL_TO_DECODE, (
                    f"{why}; with one more decode: ITL {to_decode[1] * 1e3:.0f} ms, TTFT {to_decode[0] * 1e3:.0f} ms"), \
                    to_decode
        if ttft > self.ttft_slo_s:
            why = f"TTFT {ttft * 1e3:.0f} ms over its {self.ttft_slo_s * 1e3:.0f} ms objective"
            if decode.num_servers < 2:
                return Action.HOLD, f"{why}, but the one decode server cannot leave its role", (ttft, itl)
            if to_prefill[1] <= self.itl_slo_s:
                return Action.DECODE_TO_PREFILL, (
                    f"{why}; with one more prefill: TTFT {to_prefill[0] * 1e3:.0f} ms, ITL "
                    f"{to_prefill[1] * 1e3:.0f} ms"), to_prefill
        return Action.HOLD, (f"TTFT {ttft * 1e3:.0f} ms and ITL {itl * 1e3:.0f} ms against {self.ttft_slo_s * 1e3:.0f} "
                             f"and {self.itl_slo_s * 1e3:.0f} ms: no move pays"), (ttft, itl)
