"""The decode's pace (`--itl-objective-ms`): how many requests may decode a step together and still
keep the inter-token objective, learnt from the steps this engine ran. Pure.

A step's wall time is fitted online to its work, `fixed + per_seq * decoding requests + per_token *
prompt tokens` (least squares, each step's weight decaying by DECAY a step, so the fit follows the
contexts as they grow and the host as its load changes). The pace is the most decoding requests whose
step the fit puts within the objective, at least 1 and at most the decode's --max-num-seqs. A decode
admits a request whose KV landed only while fewer run (decode/role.py): the rest keep their KV and
wait for a slot before their first token, instead of slowing every running request's next one.
"""

from __future__ import annotations

import numpy as np

from disagg.engine.step_metrics import StepMetrics

DECAY = 0.99  # a step's weight in the fit after each later step (~100 steps of memory)
MIN_STEPS = 16  # steps seen before the fit is trusted (until then: --max-num-seqs)
MIN_SPREAD = 0.25  # the decoding requests' variance (weighted) below which per_seq is not separable


class StepPace:
    def __init__(self, objective_s: float):
        self.objective_s = objective_s
        self._xx = np.zeros((3, 3))  # decayed sums of x x^T, x = (1, decoding requests, prompt tokens)
        self._xy = np.zeros(3)  # ... and of x * wall time
        self.num_steps = 0

    def add(self, step: StepMetrics) -> None:
        """One step the engine ran (only steps that decoded tell the pace)."""
        if not step.num_decode_seqs:
            return
        x = np.array([1.0, step.num_decode_seqs, step.num_prefill_tokens])
        self._xx = DECAY * self._xx + np.outer(x, x)
        self._xy = DECAY * self._xy + x * step.wall_s
        self.num_steps += 1

    def fit(self) -> tuple[float, float, float] | None:
        """(fixed, per_seq, per_token) seconds, or None before MIN_STEPS. Where the batch size barely
        varied, a step's time is put all on its requests (fixed 0): the pace that follows is the
        cautious one, and a smaller batch then shows what a request costs."""
        if self.num_steps < MIN_STEPS:
            return None
        weight, seqs = self._xx[0, 0], self._xx[0, 1]
        spread = self._xx[1, 1] / weight - (seqs / weight) ** 2
        if spread < MIN_SPREAD:  # no intercept: wall ~ per_seq * seqs + per_token * tokens
            sub = self._xx[1:, 1:] + np.diag([0.0, 1e-9 * max(self._xx[2, 2], 1.0)])
            per_seq, per_token = np.linalg.solve(sub, self._xy[1:])
            return 0.0, float(per_seq), float(per_token)
        ridge = np.diag([0.0, 0.0, 1e-9 * max(self._xx[2, 2], 1.0)])  # prompt tokens may never have run
        fixed, per_seq, per_token = np.linalg.solve(self._xx + ridge, self._xy)
        return float(fixed), float(per_seq), float(per_token)

    def cap(self, limit: int) -> int:
        """How many requests may decode together now: the fit's most within the objective, in [1, limit]."""
        fit = self.fit()
        if fit is None or fit[1] <= 0:
            return limit
        fixed, per_seq, _ = fit
        return max(1, min(limit, int((self.objective_s - fixed) / per_seq)))
