"""Per-step engine metrics (Dynamo calls them forward-pass metrics): what one engine step computed
and how long it took, the figures a planner fits its TTFT and ITL estimates to. Pure Python."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from disagg.engine.scheduler import SchedulerOutput

MAX_KEPT_STEPS = 4096  # steps kept until taken (a worker takes them twice a second)


@dataclass(frozen=True)
class StepMetrics:
    """One engine step that ran the model."""

    wall_s: float  # schedule, run, update: the step's wall time
    num_prefill_tokens: int  # prompt tokens computed (chunks of prompts)
    num_decode_seqs: int  # requests that computed generated tokens (one each in a decode step)
    num_decode_kv_tokens: int  # the KV those decode requests attended over (their context lengths)
    num_running: int  # requests running after the step
    num_waiting: int  # requests queued after the step (not admitted yet)


def measure(scheduled: SchedulerOutput, wall_s: float, num_running: int, num_waiting: int) -> StepMetrics:
    """The step's figures from what it scheduled: a sequence's tokens before its prompt's end are
    prefill; a sequence past it decodes, over its context (its start position plus its tokens)."""
    prefill = decode = decode_kv = 0
    for seq in scheduled.seqs:
        end = seq.start_pos + len(seq.token_ids)
        prompt_part = max(min(end, seq.num_prompt_tokens) - seq.start_pos, 0)
        prefill += prompt_part
        if prompt_part < len(seq.token_ids):
            decode, decode_kv = decode + 1, decode_kv + end
    return StepMetrics(wall_s, prefill, decode, decode_kv, num_running, num_waiting)


class StepLog:
    """The last MAX_KEPT_STEPS steps not taken yet (the oldest are dropped first)."""

    def __init__(self, max_kept: int = MAX_KEPT_STEPS):
        self._steps: deque[StepMetrics] = deque(maxlen=max_kept)
        self.last: StepMetrics | None = None  # the latest step, taken or not
        self.num_added = 0  # steps added so far: a reader of `last` tells a new one by it

    def add(self, step: StepMetrics) -> None:
        self._steps.append(step)
        self.last, self.num_added = step, self.num_added + 1

    def take(self) -> list[StepMetrics]:
        """Every kept step, oldest first; the log is empty after."""
        steps = list(self._steps)
        self._steps.clear()
        return steps
