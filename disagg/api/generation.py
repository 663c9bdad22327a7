"""One request running on one DP worker: its outputs as they arrive, its totals, a clean abort.

Leaving early (client gone, handler cancelled, a write failed) closes the engine's iterator, which
aborts the request on its worker (EngineClient.generate's contract), and calls `engine.abort` too.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

import msgspec
import structlog

from disagg.api.errors import engine_error
from disagg.api.state import ApiState
from disagg.api.traces import record_finished
from disagg.tracing import current_traceparent
from disagg.config import DisaggregationMode
from disagg.http_edge import BadRequest, HttpError
from disagg.types import ErrorCode, FinishReason
from disagg.wire.engine_msgs import GenerateMsg, KVStatsMsg, OutputMsg

log = structlog.get_logger("disagg.api")
TokenLogprobs = list[tuple[int, float]]  # (sampled id, logprob), then the top-n


@dataclass
class Totals:
    """Everything known about one request so far (cumulative); renderers read it."""

    request_id: str
    dp_rank: int
    created: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    prompt_ranks: list[int | None] | None = None  # each actual prompt token's rank, beside prompt_logprobs
    prompt_token_ids: list[int] | None = None  # when the request asked for its prompt back
    prompt_text: str | None = None
    token_texts: dict[int, str] = field(default_factory=dict)  # id -> text, when the request asked for them
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    arrival_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    last_token_s: float | None = None
    inter_token_s: list[float] = field(default_factory=list)  # between outputs that carry tokens
    kv: KVStatsMsg | None = None
    kv_transfer_params: dict | None = None  # pull flow: the prefill's ticket
    queued_s: float | None = None  # from the final output: arrival until the engine first ran it
    num_preemptions: int = 0

    @property
    def e2e_latency_s(self) -> float:
        """Seconds since the request arrived."""
        return time.perf_counter() - self.arrival_s

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.token_ids)

    def add(self, out: OutputMsg) -> None:
        """Fold in one OutputMsg (which carries only what is new)."""
        if out.new_token_ids:
            now = time.perf_counter()
            if self.last_token_s is None:
                self.first_token_s = now
            else:
                self.inter_token_s.append(now - self.last_token_s)
            self.last_token_s = now
        self.token_ids.extend(out.new_token_ids)
        self.text += out.new_text
        if out.logprobs is not None:
            self.logprobs = (self.logprobs or [])
            self.logprobs.extend(out.logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_ranks = out.prompt_logprobs, out.prompt_ranks
        if out.prompt_token_ids is not None:
            self.prompt_token_ids, self.prompt_text = out.prompt_token_ids, out.prompt_text
        if out.token_texts:
            self.token_texts.update(out.token_texts)
        self.num_prompt_tokens = out.num_prompt_tokens or self.num_prompt_tokens
        self.num_cached_tokens = out.num_cached_tokens or self.num_cached_tokens
        self.kv = out.kv or self.kv
        self.kv_transfer_params = out.kv_transfer_params or self.kv_transfer_params
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason
            self.stop_reason = out.stop_reason
            self.queued_s, self.num_preemptions = out.queued_s, out.num_preemptions

    def usage(self) -> dict:
        """OpenAI-style usage (vLLM adds `prompt_tokens_details.cached_tokens`)."""
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_output_tokens,
            "total_tokens": self.num_prompt_tokens + self.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens},
        }


class Generation:
    """Runs `msg` on DP worker `dp_rank`; iterate `outputs()` (inside `aclosing`) or await `collect()`."""

    def __init__(self, state: ApiState, msg: GenerateMsg, dp_rank: int, can_hand_back: bool = False,
                 times_first_token: bool = True):
        """`can_hand_back`: this request is its HTTP answer's only one and answers nothing before its first
        output, so a role switch may end it with its 503 until then (one of n, of a batch, or a background run
        may not: its answer is under way, or already given). `times_first_token`: its wait for its first
        token tells admission how long a new request waits (api/admission.py); not a beam search's steps
        nor the later choices of n, which follow one admitted request."""
        if msg.request_id in state.inflight:
            raise BadRequest(f"request id {msg.request_id!r} is already in use", "request_id")
        self._state = state
        traceparent = current_traceparent()  # a decode sends it on to its prefill (--otlp-traces-endpoint)
        self._msg = msgspec.structs.replace(msg, traceparent=traceparent) if traceparent else msg
        self.totals = Totals(msg.request_id, dp_rank, int(time.time()))
        self._handed_back: HttpError | None = None
        self._can_hand_back = can_hand_back
        self._times_first_token = times_first_token

    def hand_back(self, error: HttpError) -> bool:
        """End the request with `error` rather than its answer (the caller aborts it on its worker); only
        while nothing was yielded, so the client got no byte and a router may send it elsewhere."""
        if self._msg.request_id not in self._state.handbacks:
            return False
        self._state.handbacks.pop(self._msg.request_id)
        self._handed_back = error
        return True

    async def outputs(self) -> AsyncIterator[OutputMsg]:
        """The engine's outputs, folded into `totals` before each is yielded; a failed request raises
        (as does one handed back: its error)."""
        rid, dp_rank = self._msg.request_id, self.totals.dp_rank
        self._state.inflight[rid] = dp_rank
        if self._can_hand_back:
            self._state.handbacks[rid] = self.hand_back
        stream = self._state.engine.generate(self._msg, dp_rank)
        waits = self._state.waits
        if self._times_first_token:
            waits.dispatched(rid, time.monotonic())
        done = False
        try:
            async for out in stream:
                if self._handed_back is not None:
                    raise self._handed_back
                if out.error is not None:
                    done = True  # the worker already dropped the request
                    if out.error_code is ErrorCode.KV_CHECKSUM_MISMATCH:
                        self._state.metrics.transfer_failed("checksum")
                    raise engine_error(out.error, out.error_status, out.error_param, out.error_code)
                self.totals.add(out)
                if out.new_token_ids:  # its first token (an abort's last output carries none)
                    waits.answered(rid, time.monotonic())
                self._state.handbacks.pop(rid, None)  # from its first output on the client may have bytes
                yield out
                if out.finish_reason is not None:
                    done = True
                    break
            if self._handed_back is not None:
                raise self._handed_back
            if not done:
                raise HttpError(500, f"the engine ended request {rid} without a finish reason")
        finally:
            self._state.inflight.pop(rid, None)
            self._state.handbacks.pop(rid, None)
            waits.dropped(rid)
            await self._close(stream, done)
            self._report(done)

    async def collect(self) -> Totals:
        """Run to the end; the totals."""
        async with aclosing(self.outputs()) as outputs:
            async for _ in outputs:
                pass
        return self.totals

    async def _close(self, stream: AsyncIterator[OutputMsg], done: bool) -> None:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()  # aborts the request if it is still running
        if not done:
            # Also abort explicitly: a generator that a cancellation already ended never sees its
            # close, and an iterator may have no aclose. Aborting a finished request is a no-op.
            await self._state.engine.abort(self._msg.request_id)

    def _max_tokens(self, t: Totals) -> int:
        """The request's max_tokens as vLLM records it: given, else the default, else the context left."""
        sampling = self._msg.sampling
        if sampling.max_tokens is not None:
            return sampling.max_tokens
        if sampling.default_max_tokens is not None:
            return sampling.default_max_tokens
        return max(self._state.engine.model.max_model_len - t.num_prompt_tokens, 0)

    def _report(self, done: bool) -> None:
        t = self.totals
        e2e_s = t.e2e_latency_s
        if not done or t.finish_reason is None:
            log.info("request stopped early", dp_rank=t.dp_rank, completion_tokens=t.num_output_tokens)
            return
        ttft_s = None if t.first_token_s is None else t.first_token_s - t.arrival_s
        self._state.metrics.observe_request(t.num_prompt_tokens, t.num_output_tokens, ttft_s, e2e_s, dp_rank=t.dp_rank,
                                            finish_reason=t.finish_reason, inter_token_s=t.inter_token_s,
                                            queued_s=t.queued_s, max_tokens=self._max_tokens(t),
                                            num_preemptions=t.num_preemptions)
        if t.kv is not None:
            self._state.metrics.observe_kv(t.kv, t.dp_rank)
        if self._state.tracing is not None:
            record_finished(self._state.tracing, t, self._state.engine.mode, self._msg.bootstrap_room)
        if self._state.engine.mode is DisaggregationMode.DECODE:  # its KV came with it, or not
            self._state.metrics.decode_prefills.labels("local" if t.kv is None else "remote").inc()
        log.info("request finished", dp_rank=t.dp_rank, finish_reason=t.finish_reason,
                 prompt_tokens=t.num_prompt_tokens, completion_tokens=t.num_output_tokens,
                 e2e_latency_s=round(e2e_s, 6))


async def hand_back_unanswered(state: ApiState, error: HttpError) -> int:
    """End every running request that has sent its client nothing with `error` (a role switch's 503, which
    our router answers by sending the request to another server), aborting it on its worker; how many."""
    handed = [rid for rid, hand_back in list(state.handbacks.items())
              if hand_back(HttpError(error.status, error.message, param=error.param, code=error.code,
                                     error_type=error.error_type, headers=dict(error.headers)))]
    for rid in handed:
        await state.engine.abort(rid)
    if handed:
        log.info("requests handed back", num_requests=len(handed), status=error.status, error=error.message)
    return len(handed)
