"""The decode's pace (`--itl-objective-ms`): how many requests may decode a step together and still
keep the inter-token objective, learnt from the steps this engine ran. Pure.

A step's wall time is fitted online to its work, `fixed + per_seq * decoding requests + per_token *
prompt tokens` (least squares, each step's weight decaying by DECAY a step, so the fit follows the
contexts as they grow and the host as its load changes). The pace is the most decoding requests whose
step the fit puts within the objective, at least 1 and at most the decode's --max-num-seqs (while the
batch size has not varied enough to fit, it explores: one more request while the steps keep the
objective, one fewer while they do not). A decode admits a request whose KV landed only while fewer
run, and starts no more requests sent whole (decode/limits.py): the rest wait for a slot before their
first token, instead of slowing every running request's next one.
"""

from __future__ import annotations

import numpy as np

from disagg.engine.step_metrics import StepMetrics

DECAY = 0.99  # a step's weight in the fit after each later step (~100 steps of memory)
MIN_STEPS = 16  # steps seen before the fit is trusted (until then: --max-num-seqs)
MIN_SPREAD = 0.25  # the decoding requests' variance (weighted) below which per_seq is not separable
PLAIN_SHARE = 0.1  # the share of recent steps without prompt tokens from which those alone judge exploring


class StepPace:
    def __init__(self, objective_s: float):
        self.objective_s = objective_s
        self._xx = np.zeros((3, 3))  # decayed sums of x x^T, x = (1, decoding requests, prompt tokens)
        self._xy = np.zeros(3)  # ... and of x * wall time
        self._plain = np.zeros(3)  # decayed (weight, decoding requests, wall time) of the steps with no prompt tokens
        self.num_steps = 0

    def add(self, step: StepMetrics) -> None:
        """One step the engine ran (only steps that decoded tell the pace)."""
        if not step.num_decode_seqs:
            return
        x = np.array([1.0, step.num_decode_seqs, step.num_prefill_tokens])
        self._xx = DECAY * self._xx + np.outer(x, x)
        self._xy = DECAY * self._xy + x * step.wall_s
        self._plain = DECAY * self._plain + (0.0 if step.num_prefill_tokens else 1.0) * np.array(
            [1.0, step.num_decode_seqs, step.wall_s])
        self.num_steps += 1

    def fit(self) -> tuple[float, float, float] | None:
        """(fixed, per_seq, per_token) seconds, or None before MIN_STEPS and while the batch size has
        barely varied (a fixed cost and a request's cost cannot be told apart then)."""
        if self.num_steps < MIN_STEPS or self._spread() < MIN_SPREAD:
            return None
        ridge = np.diag([0.0, 0.0, 1e-9 * max(self._xx[2, 2], 1.0)])  # prompt tokens may never have run
        try:
            fixed, per_seq, per_token = np.linalg.solve(self._xx + ridge, self._xy)
        except np.linalg.LinAlgError:
            return None
        return float(fixed), float(per_seq), float(per_token)

    def cap(self, limit: int) -> int:
        """How many requests may decode together now, in [1, limit]: the fit's most within the
        objective; while the batch size has barely varied, one more than it while its steps keep the
        objective (so that the pace finds out what a request costs) and it less one while they do not.
        Steps that also computed prompt tokens are left out of that where others are at least
        PLAIN_SHARE of the recent ones: a document prefilled beside the batch (requests sent whole) says
        nothing of what the batch costs."""
        if self.num_steps < MIN_STEPS:
            return limit
        fit = self.fit()
        if fit is None:
            plain = self._plain[0] >= PLAIN_SHARE * self._xx[0, 0]
            weight, seqs, wall_s = self._plain if plain else (self._xx[0, 0], self._xx[0, 1], self._xy[0])
            batch, wall = round(seqs / weight), wall_s / weight
            return max(1, min(limit, batch + 1 if wall <= self.objective_s else batch - 1))
        fixed, per_seq, _ = fit
        if not per_seq > 0:
            return limit
        return max(1, min(limit, int((self.objective_s - fixed) / per_seq + 1e-9)))

    def _spread(self) -> float:
        """The decoding requests' variance over the weighted steps."""
        weight = self._xx[0, 0]
        return self._xx[1, 1] / weight - (self._xx[0, 1] / weight) ** 2
