"""Plain values that cross every boundary: sampling parameters, finish reasons, outputs, errors.

No torch here: the HTTP front door and the router import this module.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class InvalidRequest(ValueError):
    """User input that cannot be served; `param` names the offending field (OpenAI's `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class EngineSleeping(RuntimeError):
    """The engine is asleep (`sleep()` was called); `wake_up()` first."""


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # aborted by the caller, a disconnect or a failure

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. `temperature == 0` means greedy, as in vLLM."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-n logprobs per sampled token (0: only the sampled token's)
    prompt_logprobs: int | None = None  # top-n per prompt token
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._validate()

    def _validate(self) -> None:
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens > 0, "max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}"),
            (isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens", f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}"),
            (self.temperature >= 0, "temperature", f"temperature must be non-negative, got {self.temperature}"),
            (0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p}"),
            (isinstance(self.top_k, int) and (self.top_k >= 0 or self.top_k == -1), "top_k", f"top_k must be -1 (off) or non-negative, got {self.top_k}"),
            (0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p}"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", f"logprobs must be between 0 and 20, got {self.logprobs}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs", f"prompt_logprobs must be between 0 and 20, got {self.prompt_logprobs}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty strings"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", "stop_token_ids must be non-negative integers"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequest(message, param)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


TopLogprobs = dict[int, float]  # token id -> logprob


@dataclass
class CompletionOutput:
    """One request's generated part so far (cumulative)."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TopLogprobs] | None = None  # one dict per generated token, sampled token included
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or token id that matched


@dataclass
class RequestOutput:
    """What the engine reports for one request after a step: cumulative, plus what is new."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: CompletionOutput
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    prompt_logprobs: list[TopLogprobs | None] | None = None  # first entry None, as in vLLM
    num_cached_tokens: int = 0
    error: str | None = None
    num_logprobs: int | None = None  # top-n asked for per generated token (SamplingParams.logprobs)
    num_prompt_logprobs: int | None = None

    @property
    def finished(self) -> bool:
        return self.outputs.finish_reason is not None
