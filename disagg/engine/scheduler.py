"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.

Pure Python. Each step: running requests first (those decoding, then those still prefilling, each
in the order they started; at most max_num_seqs), then waiting ones, within a token budget and the
prompt-token cap. The waiting queue is in arrival order (fcfs) or by (priority, arrival) under the
priority policy; when the KV cache runs out, the last request to start (fcfs) or the running one
with the largest (priority, arrival) (vLLM's rule) is preempted and queued again. A request whose computed tokens reach its total after this step samples one token.
The P/D hooks are plain states: WAITING_FOR_KV (blocks reserved, KV written by someone else) and
HOLDING (finished, blocks kept until released).
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from disagg.engine_config import SchedulerConfig, SchedulingPolicy
from disagg.engine.kv_cache_manager import KVCacheManager
from disagg.engine.request import Request, RequestStatus
from disagg.types import FinishReason, SamplingParams, TopLogprobs


@dataclass(frozen=True)
class ScheduledSeq:
    """What the model runner needs for one request in one step: plain values only."""

    request_id: str
    token_ids: list[int]  # the tokens to compute this step
    start_pos: int  # position of token_ids[0]
    block_ids: list[int]
    sample: bool  # this step reaches the end of the known tokens: sample the next one
    prompt_logprobs: bool  # return logprobs for the prompt tokens computed this step
    sampling_params: SamplingParams
    num_output_tokens: int  # outputs so far (for min_tokens)
    num_prompt_tokens: int
    next_token_id: int | None  # the known token after this chunk (prompt logprobs of a chunk's last row)
    # The request's tokens so far, for the logits processors (penalties, bad words); empty when its
    # sampling has none, so other requests copy nothing.
    prompt_token_ids: tuple[int, ...] = ()
    output_token_ids: tuple[int, ...] = ()
    prompt_logprobs_from: int = 0  # rows already recorded (a recompute's chunk straddling them): skipped


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprobs: TopLogprobs | None = None  # sampled token included


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int):
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.remote: dict[str, Request] = {}  # WAITING_FOR_KV
        self.holding: dict[str, Request] = {}  # HOLDING
        self.requests: dict[str, Request] = {}
        self._finished: list[Request] = []
        self.prefix_cache_queries = 0  # prompt tokens looked up in the prefix cache (vLLM's counters)
        self.prefix_cache_hits = 0

    # ---- intake -------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        self.requests[request.request_id] = request
        self._enqueue(request)

    def _enqueue(self, request: Request, preempted: bool = False) -> None:
        """Into the waiting queue: fcfs at the back (a preempted request at the front, it arrived
        first); priority in (priority, arrival) order, after equal keys."""
        if self.config.scheduling_policy is SchedulingPolicy.PRIORITY:
            bisect.insort_right(self.waiting, request, key=_priority_key)
        elif preempted:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def reserve_for_remote_kv(self, request: Request) -> bool:
        """Reserve blocks for a prompt whose KV another engine will write; False if no room. The
        prompt's longest cached prefix is reused (`num_cached_tokens`, whole blocks, shared): only
        the blocks after it are new, and only they are written."""
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        hits, num_hit_tokens = self.kv.get_computed_blocks(request)
        if not self.kv.allocate_slots(request, request.num_prompt_tokens - num_hit_tokens, hits):
            return False
        request.num_cached_tokens = num_hit_tokens
        self._count_lookup(request, request.num_prompt_tokens, num_hit_tokens)
        request.status = RequestStatus.WAITING_FOR_KV
        self.requests[request.request_id] = request
        self.remote[request.request_id] = request
        return True

    def admit_remote_kv(self, request_id: str, first: SampledToken,
                        prompt_logprobs: list[TopLogprobs | None] | None = None,
                        prompt_ranks: list[int | None] | None = None) -> Request | None:
        """The prompt's KV is in the reserved blocks: run the request from its first token on (a
        prompt-only request ends there, without it). `prompt_logprobs` and `prompt_ranks` are those the
        remote engine computed. None when the request no longer waits for KV (aborted or failed meanwhile)."""
        if (request := self.remote.pop(request_id, None)) is None:
            return None
        request.num_computed_tokens = request.num_prompt_tokens
        self.kv.cache_full_blocks(request, request.num_computed_tokens)
        request.status = RequestStatus.RUNNING
        request.mark_scheduled()
        self.running.append(request)
        if request.wants_prompt_logprobs and prompt_logprobs is not None:
            request.prompt_logprobs = list(prompt_logprobs)
            request.prompt_ranks = list(prompt_ranks or [None] * len(prompt_logprobs))
        if request.sampling_params.prompt_only:
            self.finish(request, FinishReason.LENGTH)
        else:
            self.append_token(request, first)
        return request

    def admit_remote_prefix(self, request_id: str, num_computed_tokens: int) -> Request | None:
        """The KV of the prompt's first `num_computed_tokens` is in the reserved blocks (read from
        another engine): compute the rest here, from the first output token on as usual."""
        request = self.remote.pop(request_id, None)
        if request is None:
            return None
        assert 0 <= num_computed_tokens < request.num_prompt_tokens, "the last prompt token is computed here"
        request.num_computed_tokens = num_computed_tokens
        self.kv.cache_full_blocks(request, num_computed_tokens)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return request

    # ---- schedule -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        for request in self._running_decodes_first():
            if budget == 0 or len(scheduled) == self.config.max_num_seqs:
                break  # a decode admits every request whose KV landed; at most --max-num-seqs of them run a step
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_left = request.num_tokens - request.num_computed_tokens
            room = self._prefill_room(budget, scheduled) if num_left > 1 else budget
            if room == 0:
                continue  # this step's prompt tokens are spent (--max-prefill-tokens-per-step)
            num_new = self._chunk(num_left, room)
            num_preempted = len(out.preempted_ids)
            if self._allocate_or_preempt(request, num_new, out, scheduled):
                scheduled.append((request, num_new))
                budget -= num_new
            if len(out.preempted_ids) != num_preempted:  # a victim scheduled earlier in this loop gave its tokens back
                budget = self.config.max_num_batched_tokens - sum(n for _, n in scheduled)
        if not out.preempted_ids:
            budget = self._schedule_waiting(budget, scheduled)
        out.seqs = [self._seq(r, n) for r, n in scheduled]
        return out

    def _running_decodes_first(self) -> list[Request]:
        """The running requests, those with one token to compute (decoding) before those still
        prefilling, each group in the order it started: a prefill chunk takes what the decodes leave
        of the budget, so it never delays a decoding request's next token."""
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens <= 1]
        return decoding + [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]

    def _prefill_room(self, budget: int, scheduled: list[tuple[Request, int]]) -> int:
        """What a prompt chunk may take now: the budget, within --max-prefill-tokens-per-step less the
        prompt tokens already scheduled this step (a decoding request's one token is not counted)."""
        cap = self.config.max_prefill_tokens_per_step
        if not cap:
            return budget
        used = sum(n for r, n in scheduled if r.num_tokens - r.num_computed_tokens > 1)
        return max(0, min(budget, cap - used))

    def _chunk(self, num_left: int, budget: int) -> int:
        """Tokens a request computes this step: what it has left, within the budget and the long-prefill cap."""
        cap = self.config.long_prefill_token_threshold
        return min(num_left, budget, cap) if cap else min(num_left, budget)

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput,
                             scheduled: list[tuple[Request, int]]) -> bool:
        while not self.kv.allocate_slots(request, num_new):
            victim = self._victim()
            if victim is request and len(self.running) == 1:
                if self.holding or self.remote:
                    # Blocks held for a remote reader (or writer) come back when that transfer ends, and
                    # a request waiting for KV runs, then frees its own: wait for them in the queue, as a
                    # preempted request. Finishing here cut a prefill short of its prompt.
                    self._preempt(request)
                    out.preempted_ids.append(request.request_id)
                    return False
                # Alone and still out of blocks: the cache cannot hold this request any longer.
                self.finish(request, FinishReason.LENGTH)
                return False
            self._preempt(victim)
            out.preempted_ids.append(victim.request_id)
            scheduled[:] = [(r, n) for r, n in scheduled if r is not victim]  # priority: it may have run first
            if victim is request:
                return False
        return True

    def _victim(self) -> Request:
        """The running request to preempt: the last to start (fcfs), or the largest (priority,
        arrival) (vLLM's rule)."""
        if self.config.scheduling_policy is SchedulingPolicy.PRIORITY:
            return max(self.running, key=_priority_key)
        return self.running[-1]

    def _schedule_waiting(self, budget: int, scheduled: list[tuple[Request, int]]) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hits, num_hit_tokens = ([], 0)
            if request.num_computed_tokens == 0:
                hits, num_hit_tokens = self.kv.get_computed_blocks(request)
            room = self._prefill_room(budget, scheduled)
            if room == 0:
                break
            num_new = self._chunk(request.num_tokens - request.num_computed_tokens - num_hit_tokens, room)
            if not self.kv.allocate_slots(request, num_new, hits):
                break
            self.waiting.popleft()
            if request.num_computed_tokens == 0:
                self._count_lookup(request, request.num_tokens, num_hit_tokens)
            if request.num_preemptions == 0 and request.num_computed_tokens == 0:
                request.num_cached_tokens = num_hit_tokens
            request.num_computed_tokens += num_hit_tokens
            request.status = RequestStatus.RUNNING
            request.mark_scheduled()
            self.running.append(request)
            scheduled.append((request, num_new))
            budget -= num_new
        return budget

    def _count_lookup(self, request: Request, num_tokens: int, num_hit_tokens: int) -> None:
        """vLLM's prefix-cache counters; a request that may not read the cache (it wants prompt
        logprobs) is no query, as vLLM skips it."""
        if self.kv.enable_caching and not request.wants_prompt_logprobs:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self._enqueue(request, preempted=True)

    def _seq(self, request: Request, num_new: int) -> ScheduledSeq:
        start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
        recorded = max(len(request.prompt_logprobs) - 1, 0)  # row p predicts token p + 1; entry 0 is None
        return ScheduledSeq(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start:end],
            start_pos=start,
            block_ids=list(request.block_ids),
            sample=end == request.num_tokens and not request.sampling_params.prompt_only,
            prompt_logprobs=request.wants_prompt_logprobs and start <= recorded < min(end, request.num_prompt_tokens),
            prompt_logprobs_from=max(recorded - start, 0),
            sampling_params=request.sampling_params,
            num_output_tokens=len(request.output_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            next_token_id=request.all_token_ids[end] if end < request.num_tokens else None,
            **_history(request, end == request.num_tokens),
        )

    # ---- update -------------------------------------------------------------------------------

    def update(self, out: SchedulerOutput, sampled: dict[str, SampledToken]) -> list[Request]:
        """Advance computed tokens, append sampled tokens, finish what stops. Returns touched requests."""
        touched = []
        for seq in out.seqs:
            request = self.requests.get(seq.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens += len(seq.token_ids)
            self.kv.cache_full_blocks(request, request.num_computed_tokens)
            if seq.request_id in sampled:
                self.append_token(request, sampled[seq.request_id])
            elif request.sampling_params.prompt_only and request.num_computed_tokens >= request.num_prompt_tokens:
                self.finish(request, FinishReason.LENGTH)  # scoring: the prompt is all it asked for
            touched.append(request)
        return touched

    def append_token(self, request: Request, token: SampledToken) -> None:
        request.output_token_ids.append(token.token_id)
        if token.logprobs is not None:
            request.logprobs.append(token.logprobs)
        reason, stop = self._check_stop(request, token.token_id)
        if reason is not None:
            self.finish(request, reason, stop)

    def _check_stop(self, request: Request, token_id: int) -> tuple[FinishReason | None, int | None]:
        params = request.sampling_params
        num_out = len(request.output_token_ids)
        if num_out >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return FinishReason.STOP, None
            if token_id in params.stop_token_ids:
                return FinishReason.STOP, token_id
        if num_out >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH, None
        return None, None

    # ---- finish, abort, release ---------------------------------------------------------------

    def finish(self, request: Request, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        """End a request wherever it is; free its blocks unless it holds them for a remote reader."""
        if request.is_finished:
            return
        # Blocks reserved for a remote writer stay out of the pool until the caller knows no write
        # can land any more (release()): reusing them earlier could let a late write corrupt them.
        request.quarantined = request.status is RequestStatus.WAITING_FOR_KV
        self._unlink(request)
        self._finished.append(request)
        hold = (request.hold_blocks and reason is not FinishReason.ABORT) or request.quarantined
        request.finish(reason, stop_reason)
        if not hold:
            request.status = RequestStatus.FINISHED
            self.kv.free(request)
            self.requests.pop(request.request_id, None)
        else:
            request.status = RequestStatus.HOLDING
            self.holding[request.request_id] = request

    def abort(self, request_id: str) -> Request | None:
        """Abort at any stage (waiting, running, waiting for KV, holding); every block is freed."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status is RequestStatus.HOLDING:
            if request.quarantined:
                return None  # ended already; only release() frees its blocks
            self.release(request_id)
            return request
        self.finish(request, FinishReason.ABORT)
        return request

    def release(self, request_id: str) -> bool:
        """Free the blocks a HOLDING request kept. False when there is no such request."""
        request = self.holding.pop(request_id, None)
        if request is None:
            return False
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
        self.requests.pop(request_id, None)
        return True

    def _unlink(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        self.remote.pop(request.request_id, None)

    def drain_finished(self) -> list[Request]:
        """Requests finished since the last call (by stops, aborts or lack of cache)."""
        finished, self._finished = self._finished, []
        return finished

    @property
    def num_running(self) -> int:
        """Requests that run a step (at most --max-num-seqs; vLLM's num_requests_running)."""
        return min(len(self.running), self.config.max_num_seqs)

    @property
    def num_waiting(self) -> int:
        """The waiting queue, and on a decode the admitted requests past --max-num-seqs."""
        return len(self.waiting) + len(self.running) - self.num_running

    @property
    def num_quarantined_blocks(self) -> int:
        """Blocks of ended requests that a remote writer may still write (not free, not in use)."""
        return sum(len(r.block_ids) for r in self.holding.values() if r.quarantined)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)


def _priority_key(request: Request) -> tuple[int, float]:
    return request.priority, request.arrival_time


def _history(request: Request, sample: bool) -> dict[str, tuple[int, ...]]:
    """The token history a sampling step's logits processors read (none when they read nothing)."""
    params = request.sampling_params
    if not sample or not params.has_processors:
        return {}
    prompt = tuple(request.prompt_token_ids) if params.has_penalties else ()
    return {"prompt_token_ids": prompt, "output_token_ids": tuple(request.output_token_ids)}
