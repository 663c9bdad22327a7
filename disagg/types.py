"""Plain values that cross every boundary: sampling parameters, finish reasons, outputs, errors.

No torch here: the HTTP front door and the router import this module.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, fields

# Seeds seed a torch.Generator, whose manual_seed takes [-2**63, 2**64 - 1]; vLLM's API takes a
# signed 64-bit integer. Both hold for the intersection.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
GREEDY_TEMPERATURE = 1e-5  # a temperature below this samples greedily (vLLM's _SAMPLING_EPS)
MAX_LOGPROBS = 20


class ErrorCode(str, enum.Enum):
    """The `code` of an error answer that a router acts on (OpenAI's error `code`)."""

    DRAINING = "draining"  # a 503: the server is shutting down; send the request to another one
    SHUTDOWN = "shutdown"  # the shutdown aborted this request
    LOCAL_PREFILL_REFUSED = "local_prefill_refused"  # a 400: a decode sent a request alone will not prefill it
    ROLE_SWITCHING = "role_switching"  # a 503: the server is switching between prefill and decode; send it elsewhere
    STALE_ROLE_EPOCH = "stale_role_epoch"  # a 503: the request was routed for a role this server no longer has
    INCOMPATIBLE_PEER = "incompatible_peer"  # a 503: the prefill refused this decode (its KV layout, backend)
    KV_CHECKSUM_MISMATCH = "kv_checksum_mismatch"  # a 503: the KV that landed is not what the prefill wrote
    ABORTED_BY_DECODE = "aborted_by_decode"  # a prefill leg its decode gave up: the decode's answer says why


class FaultKind(str, enum.Enum):
    """A fault a server started with --enable-fault-injection injects on purpose (docs/testing.md): the
    front applies stall, kill and fail_requests itself; the worker the others (transfer ones on P/D only)."""

    STALL = "stall"
    KILL = "kill"
    FAIL_REQUESTS = "fail_requests"
    SLOW_STEPS = "slow_steps"
    DELAY_TRANSFERS = "delay_transfers"
    FAIL_TRANSFERS = "fail_transfers"
    CORRUPT_TRANSFERS = "corrupt_transfers"  # a decode: the next `count` rooms' KV lands with a byte flipped
    STOP_HEARTBEATS = "stop_heartbeats"

    def __str__(self) -> str:
        return self.value


class InvalidRequest(ValueError):
    """User input that cannot be served; `param` names the offending field (OpenAI's `param`), `code`
    what a router may do about it."""

    def __init__(self, message: str, param: str | None = None, code: ErrorCode | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class EngineSleeping(RuntimeError):
    """The engine is asleep (`sleep()` was called); `wake_up()` first."""


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # aborted by the caller, a disconnect or a failure

    def __str__(self) -> str:
        return self.value


class GrammarKind(str, enum.Enum):
    """What a structured-output spec is written in."""

    JSON_SCHEMA = "json_schema"  # a JSON schema (as JSON text); '{"type": "object"}' for json_object
    REGEX = "regex"
    GRAMMAR = "grammar"  # EBNF/GBNF (SGLang's `ebnf`, vLLM's `grammar`) or Lark
    CHOICE = "choice"  # a JSON list of strings: the output is one of them

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the whole output; `param` names the request field it came from (for errors)."""

    kind: GrammarKind
    spec: str
    param: str = "response_format"


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. A temperature below 1e-5 (0 included) means greedy, as in vLLM.

    `max_tokens=None` means "not set": the engine generates at most `default_max_tokens` (16, as
    vLLM's default; the HTTP endpoints pass their own) and never past the context; None there too
    means "the rest of the context". A `max_tokens` that is set must fit the context with the prompt,
    or the engine refuses the request at admission (vLLM's rule); a default never does.
    `max_tokens=0` is a prompt-only request (scoring): the prompt is computed, its prompt logprobs
    returned, and it finishes with LENGTH and no output token.
    """

    max_tokens: int | None = None
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
    logprob_token_ids: tuple[int, ...] = ()  # also these tokens' logprobs wherever logprobs are returned
    skip_special_tokens: bool = True
    default_max_tokens: int | None = 16  # applies when max_tokens is None; capped by the context
    # vLLM's penalties: presence and frequency count the output, repetition the prompt and output.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> bias, clamped to [-100, 100] as vLLM does
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be sampled
    bad_words: tuple[str, ...] = ()  # words never generated (vLLM); the engine tokenizes them
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()  # set by the engine from bad_words
    structured_output: StructuredOutput | None = None  # grammar-constrained output (disagg/engine/grammar.py)
    # vLLM's: keep this many prompt tokens (-1: the context length), dropped from `truncation_side`
    # ("left" keeps the last ones, vLLM's default); None: the whole prompt, which must fit
    truncate_prompt_tokens: int | None = None
    truncation_side: str = "left"

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if not isinstance(self.stop, (list, tuple)) or not isinstance(self.stop_token_ids, (list, tuple)):
            name = "stop" if not isinstance(self.stop, (list, tuple)) else "stop_token_ids"
            raise InvalidRequest(f"{name} must be a list", name)
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logprob_token_ids", tuple(self.logprob_token_ids))
        self._normalize_processors()
        self._validate()

    def _normalize_processors(self) -> None:
        """Lists become tuples and logit_bias keys ints (JSON sends them as strings), as vLLM reads them."""
        for name in ("allowed_token_ids", "bad_words"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (list, tuple)):
                raise InvalidRequest(f"{name} must be a list", name)
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        object.__setattr__(self, "bad_words", tuple(self.bad_words))
        object.__setattr__(self, "bad_words_token_ids", tuple(tuple(ids) for ids in self.bad_words_token_ids))
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))

    def _validate(self) -> None:
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise InvalidRequest(f"{name} must be a finite number, got {value!r}", name)
        if self.max_tokens is not None and not (_is_int(self.max_tokens) and self.max_tokens >= 0):
            raise InvalidRequest(f"max_tokens must be at least 0, got {self.max_tokens}", "max_tokens")
        if self.default_max_tokens is not None and not (_is_int(self.default_max_tokens) and self.default_max_tokens > 0):
            raise InvalidRequest(f"default_max_tokens must be at least 1, got {self.default_max_tokens}", "default_max_tokens")
        bound = self.max_tokens if self.max_tokens is not None else self.default_max_tokens
        checks = [
            (_is_int(self.min_tokens) and self.min_tokens >= 0 and (bound is None or self.min_tokens <= bound),
             "min_tokens", f"min_tokens must be between 0 and max_tokens ({bound}), got {self.min_tokens}"
             if bound is not None else f"min_tokens must be non-negative, got {self.min_tokens}"),
            (self.temperature >= 0, "temperature", f"temperature must be non-negative, got {self.temperature}"),
            (0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p}"),
            (_is_int(self.top_k) and (self.top_k >= 0 or self.top_k == -1), "top_k", f"top_k must be -1 (off) or non-negative, got {self.top_k}"),
            (0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p}"),
            (self.seed is None or (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX), "seed",
             f"seed must be an integer between {SEED_MIN} and {SEED_MAX} (64-bit signed), got {self.seed}"),
            (self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS), "logprobs",
             f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}"),
            (self.prompt_logprobs is None or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
             "prompt_logprobs", f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.prompt_logprobs}"),
            (self.truncate_prompt_tokens is None or (_is_int(self.truncate_prompt_tokens)
                                                     and (self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1)),
             "truncate_prompt_tokens", f"truncate_prompt_tokens must be -1 or at least 1, got {self.truncate_prompt_tokens}"),
            (self.truncation_side in ("left", "right"), "truncation_side",
             f"truncation_side must be 'left' or 'right', got {self.truncation_side!r}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty strings"),
            (all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", "stop_token_ids must be non-negative integers"),
            (all(_is_int(t) and t >= 0 for t in self.logprob_token_ids), "token_ids_logprob",
             "token_ids_logprob must be non-negative integers"),
            *self._processor_checks(),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequest(message, param)

    def _processor_checks(self) -> list[tuple[bool, str, str]]:
        finite = [_is_number(v) for v in (self.presence_penalty, self.frequency_penalty, self.repetition_penalty)]
        return [
            (finite[0] and -2 <= self.presence_penalty <= 2, "presence_penalty",
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (finite[1] and -2 <= self.frequency_penalty <= 2, "frequency_penalty",
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (finite[2] and 0 < self.repetition_penalty <= 2, "repetition_penalty",
             f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}"),
            (self.allowed_token_ids is None or (len(self.allowed_token_ids) > 0 and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids)),
             "allowed_token_ids", "allowed_token_ids must be a non-empty list of non-negative integers"),
            (all(isinstance(w, str) and w.strip() for w in self.bad_words), "bad_words", "bad_words must be non-empty strings"),
        ]

    @property
    def prompt_only(self) -> bool:
        """Compute the prompt (and its logprobs) without generating: `max_tokens` 0."""
        return self.max_tokens == 0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def has_processors(self) -> bool:
        """Anything beyond min_tokens that changes the logits before sampling."""
        return (self.has_penalties or bool(self.logit_bias) or self.allowed_token_ids is not None
                or bool(self.bad_words_token_ids) or self.structured_output is not None)


# Every SamplingParams field by name: request bodies copy the fields they share with it by this set.
SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))

def _logit_bias(value: object) -> dict[int, float]:
    """OpenAI's `logit_bias` (token id string -> bias) as ints -> floats clamped to [-100, 100]."""
    if not isinstance(value, dict):
        raise InvalidRequest("logit_bias must be an object mapping token ids to biases", "logit_bias")
    not_ids = [key for key in value if not _int_key(key)]
    if not_ids:  # every bad key named, as vLLM names every bad id
        raise InvalidRequest(f"logit_bias keys must be token ids, got {', '.join(map(repr, not_ids))}", "logit_bias")
    bad = [(key, bias) for key, bias in value.items() if int(key) < 0 or not _is_number(bias)]
    if bad:
        raise InvalidRequest("logit_bias must map non-negative token ids to finite numbers, got "
                             + ", ".join(f"{key!r}: {bias!r}" for key, bias in bad), "logit_bias")
    return {int(key): min(100.0, max(-100.0, float(bias))) for key, bias in value.items()}


def _int_key(key: object) -> bool:
    try:
        int(key)
    except (TypeError, ValueError):
        return False
    return True


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
    prompt_ranks: list[int | None] | None = None  # each actual prompt token's rank, as vLLM counts it (first: None)
    num_cached_tokens: int = 0
    error: str | None = None
    num_logprobs: int | None = None  # top-n asked for per generated token (SamplingParams.logprobs)
    num_prompt_logprobs: int | None = None
    logprob_token_ids: tuple[int, ...] = ()  # SamplingParams.logprob_token_ids
    queued_s: float | None = None  # arrival until it first ran (None: not yet)
    num_preemptions: int = 0

    @property
    def finished(self) -> bool:
        return self.outputs.finish_reason is not None
