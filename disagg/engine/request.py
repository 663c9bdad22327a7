"""One request's state in the engine: the token-progress model.

`num_computed_tokens` chases `num_tokens`; the scheduler decides how far each step moves it.
Pure Python.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from disagg.types import FinishReason, SamplingParams, TopLogprobs


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    WAITING_FOR_KV = enum.auto()  # blocks reserved; a remote prefill is writing the prompt's KV
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    HOLDING = enum.auto()  # finished, blocks kept until released (prefill side of P/D)
    FINISHED = enum.auto()

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.HOLDING, RequestStatus.FINISHED)


@dataclass(eq=False)  # identity: the scheduler's queues hold the objects themselves
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    hold_blocks: bool = False  # keep blocks after finishing, until release()
    priority: int = 0  # lower is served first under the priority policy (vLLM's); fcfs ignores it
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None  # when it first ran (or its remote KV was admitted): vLLM's queue ends
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # hashes of the full blocks so far
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    logprobs: list[TopLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TopLogprobs | None] = field(default_factory=list)
    prompt_ranks: list[int | None] = field(default_factory=list)  # each actual prompt token's rank (first: None)
    num_preemptions: int = 0
    error: str | None = None  # why the engine failed this request (it ends with ABORT)
    quarantined: bool = False  # ended while a remote engine may still write its blocks: kept until release()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None

    def mark_scheduled(self) -> None:
        """The request runs for the first time (later runs after a preemption keep the first)."""
        if self.scheduled_time is None:
            self.scheduled_time = time.monotonic()

    def finish(self, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.status = RequestStatus.HOLDING if self.hold_blocks else RequestStatus.FINISHED
