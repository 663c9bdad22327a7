"""The decode worker: reserves blocks, has a flow fill them with the prompt's KV, then decodes.

The role owns what both flows share: admission (each flow's checks, the prompt), the queue of
requests waiting for room in the KV cache (in arrival order), each pending request's deadline, and
the end of a request that fails or is aborted (its flow fences the blocks). decode/push.py (the
prefill writes, SGLang's protocol) and decode/pull.py (we read, vLLM's protocol) move the KV.
SUCCESS turns the request into an ordinary running one. Each request it holds is in one state of
decode/requests.py's table, and moves only as that file allows.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import msgspec
import structlog

from decode.landed import KVChecks
from decode.limits import DecodeLimits
from decode.pace import StepPace
from decode.peers import PrefillPeers
from decode.pull import PullFetch, carries_ticket, ticket_of
from decode.push import PushFetch
from decode.requests import DecodeRequest, DecodeRequests, DecodeState
from decode.waiting import Fences, PendingKV
from disagg.pd_config import DisaggConfig
from disagg.worker.outputs import admission_error, error_output
from disagg.worker.transfer import TransferRole
from disagg.engine.core import EngineCore
from disagg.engine.progress import Reservation
from disagg.types import ErrorCode, FinishReason, InvalidRequest
from disagg.wire.control_msgs import TransferState, TransferStatusMsg
from disagg.wire.engine_msgs import GenerateMsg, KVStatsMsg, OutputMsg, PdStatsMsg, StatsMsg
from kvtransfer.base import IncompatiblePeer, PeerUnavailable
from kvtransfer.checksum import ChecksumMismatch
from kvtransfer.control.endpoint import open_endpoint

log = structlog.get_logger(__name__)

PACE_LOG_INTERVAL_S = 10.0


class DecodeRole(TransferRole):
    def __init__(self, core: EngineCore, dp_rank: int, model_name: str, *, config: DisaggConfig):
        super().__init__(core, dp_rank, model_name)
        self.config = config
        self.requests = DecodeRequests()
        self.fences = Fences(lambda: self.wake())
        self.num_failed = [0, 0]  # requests failed so far: [bootstrap (prefill not reached or refused), transfer]
        # The scheduler's limits beside KV from a prefill, and as a unified server's while requests come whole.
        limits, objective_ms = core.scheduler.config, config.decode.itl_objective_ms
        self.limits = DecodeLimits((limits.max_num_seqs, limits.max_prefill_tokens_per_step),
                                   (config.decode.whole_max_num_seqs or limits.max_num_seqs, 0),
                                   StepPace(objective_ms / 1e3) if objective_ms else None)  # decode/limits.py
        self._steps_seen, self._pace_logged_at = 0, float("-inf")  # steps the pace saw; its last log line (monotonic)

    async def start(self) -> None:
        secret = self.config.cluster_secret
        self.backend, local = open_endpoint("decode", self.dp_rank, self.config.transfer_backend, self.config.rank_host,
                                            dataclasses.asdict(self.core.cache_spec()), secret,
                                            self.config.tcp_listener)
        self.backend = self.faulty(self.backend)
        self.peers = PrefillPeers(local, self.config.control, secret, self.config.decode.max_bootstrap_clients)
        self.push = PushFetch(self.core, self.dp_rank, self.config, self.backend, self.peers, self.fences)
        self.pull = PullFetch(self.core, self.config, self.backend, self.peers, self.fences)
        self.checks = KVChecks(self.backend)  # --kv-checksum

    async def close(self) -> None:
        self._schedule_as(whole=False)  # a role switch hands the engine on as it came
        for request in self.requests:
            for task in () if request.pending is None else (request.pending.task, request.pending.hold):
                if task is not None:
                    task.cancel()
        self.fences.cancel()
        await self.peers.close()
        self.backend.close()

    def _flow(self, pending: PendingKV) -> PushFetch | PullFetch:
        return self.push if pending.ticket is None else self.pull

    async def submit(self, msg: GenerateMsg) -> list[OutputMsg]:
        if msg.resume_token_ids is not None:  # migrated from a worker that died, or a beam's step: computed here
            return await super().submit(msg)
        remote = msg.bootstrap_room is not None or carries_ticket(msg)
        self._schedule_as(whole=msg.disagg_prefill_here and not remote)
        if msg.disagg_prefill_here and remote:
            return [admission_error(msg.request_id, InvalidRequest(
                "disagg_prefill_here asks this decode to prefill the prompt itself: send it without bootstrap_room "
                "and kv_transfer_params (those name a prefill that computes it)", "disagg_prefill_here"))]
        if (msg.disagg_prefill_here or self.config.decode.max_local_prefill_tokens) and not remote:
            return self._prefill_here(msg)
        try:
            ticket = ticket_of(msg)
            if ticket is None:
                self.push.check(msg)
            else:
                self.pull.check(msg, ticket)
            prompt_ids = self.prompt_ids(msg)
        except Exception as exc:
            return [error_output(msg.request_id, exc)]
        pending = PendingKV(msg, ticket, time.monotonic())
        if ticket is not None:
            self.pull.hold(pending)
        self.requests.add(DecodeRequest(msg.request_id, DecodeState.QUEUED, pending, prompt_ids))
        return self._reserve_queued()

    def _schedule_as(self, whole: bool) -> None:
        """Requests sent whole (no prefill serves) run under a unified server's limits; KV from a prefill
        (or a short rest beside it) under the decode's own, which keep its decoding requests' pace."""
        if whole != self.limits.sent_whole:
            self.limits.sent_whole = whole
            max_num_seqs, max_prefill_tokens_per_step = self._apply_limits()
            log.info("decode schedules", max_num_seqs=max_num_seqs,
                     max_prefill_tokens_per_step=max_prefill_tokens_per_step, sent_whole=whole)

    def _apply_limits(self) -> tuple[int, int]:
        """The scheduler's limits for the requests now coming and those running (decode/limits.py)."""
        config = self.core.scheduler.config
        limits = self.limits.scheduler_limits(len(self.core.scheduler.running), config.max_num_seqs)
        if limits != (config.max_num_seqs, config.max_prefill_tokens_per_step):
            self.core.set_scheduler_limits(max_num_seqs=limits[0], max_prefill_tokens_per_step=limits[1])
        return limits

    def _prefill_here(self, msg: GenerateMsg) -> list[OutputMsg]:
        """A request sent to this decode alone (selective disaggregation): prefilled here when its
        prompt tokens missing from our prefix cache, with those of the local prefills still running,
        are at most `max_local_prefill_tokens`; else refused (400, code local_prefill_refused) so that a
        router sends it again with a prefill (a busy decode hands the work to the prefill). One sent with
        `disagg_prefill_here` (no prefill serves) is prefilled here whatever its length."""
        limit = self.config.decode.max_local_prefill_tokens
        try:
            ids = self.prompt_ids(msg)
            cached = 0 if msg.sampling.prompt_logprobs is not None else self.core.cached_prefix_tokens(ids)
            backlog = self._local_backlog()
            if not msg.disagg_prefill_here and len(ids) - cached + backlog > limit:
                waiting = f", and {backlog} of other requests wait to be prefilled here" if backlog else ""
                raise InvalidRequest(
                    f"{len(ids) - cached} of the prompt's {len(ids)} tokens are not in this decode's prefix cache{waiting}; "
                    f"it prefills at most {limit} itself (--max-local-prefill-tokens): send the request with a prefill "
                    "(bootstrap_room, bootstrap_host and bootstrap_port, or kv_transfer_params)", "bootstrap_room",
                    ErrorCode.LOCAL_PREFILL_REFUSED)
            self.core.add_request(msg.request_id, ids, msg.sampling, priority=msg.priority)
        except Exception as exc:  # noqa: BLE001 - one request's input never stops the worker
            return [admission_error(msg.request_id, exc)]
        self.requests.add(DecodeRequest(msg.request_id, DecodeState.LOCAL, cached_tokens=cached))
        return []

    def sent(self, msgs: list) -> None:
        """A local prefill whose answer ended goes with it (the budget forgets computed ones sooner)."""
        super().sent(msgs)
        for msg in msgs:
            if isinstance(msg, OutputMsg) and (msg.finish_reason is not None or msg.error is not None):
                request = self.requests.get(msg.request_id)
                if request is not None and request.state is DecodeState.LOCAL:
                    self.requests.drop(msg.request_id)

    def _local_backlog(self) -> int:
        """Prompt tokens the local prefills admitted here have not computed yet (the others dropped)."""
        backlog = 0
        for request in self.requests.in_state(DecodeState.LOCAL):
            progress = self.core.request_progress(request.request_id)
            if progress is None or progress.finished or progress.num_computed_tokens >= progress.num_prompt_tokens:
                self.requests.drop(request.request_id)
            else:
                backlog += progress.num_prompt_tokens - max(progress.num_computed_tokens, request.cached_tokens)
        return backlog

    def _reserve_queued(self) -> list[OutputMsg]:
        """Reserve blocks for queued requests in arrival order while the cache has room; a request
        that waited past the deadline for room fails with 503."""
        out = []
        for request in self.requests.in_state(DecodeState.QUEUED):
            pending, request_id = request.pending, request.request_id
            try:
                reservation = self.core.reserve_for_remote_kv(request_id, request.prompt_ids, pending.msg.sampling,
                                                              pending.msg.priority)
            except Exception as exc:
                self._drop_queued(request, str(exc))
                out.append(error_output(request_id, exc))
                continue
            if reservation is None:
                wait_s = self.config.decode.waiting_timeout_s
                if time.monotonic() - pending.started > wait_s:
                    reason = f"the decode KV cache had no room for this prompt within {wait_s:g} s"
                    self._drop_queued(request, reason)
                    out.append(OutputMsg(request_id, finish_reason=FinishReason.ABORT, error_status=503, error=reason))
                    continue
                break
            self.requests.move(request_id, DecodeState.FETCHING).prompt_ids = []
            pending.task = asyncio.create_task(self._fetch_kv(pending, reservation))
        return out

    def _drop_queued(self, request: DecodeRequest, reason: str) -> None:
        """A request that ends before its blocks were reserved: only its flow lets go."""
        self.requests.drop(request.request_id)
        self._flow(request.pending).end(request.request_id, request.pending, reason)

    async def _fetch_kv(self, pending: PendingKV, reservation: Reservation) -> None:
        """The flow's fetch (of the KV after our own cached prefix), bounded by the waiting deadline;
        its verdict is handled in poll()."""
        deadline = time.monotonic() + self.config.decode.waiting_timeout_s
        try:
            fetch = self._flow(pending).fetch(pending, reservation, deadline)
            status = await asyncio.wait_for(fetch, self.config.decode.waiting_timeout_s)
        except asyncio.TimeoutError:
            status = TransferStatusMsg(room=pending.room, state=TransferState.FAILED,
                                       reason=f"no KV from prefill within {self.config.decode.waiting_timeout_s:g} s")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # bootstrap or control failures end this request only
            status = exc
        request = self.requests.get(pending.msg.request_id)
        if request is None or request.state is not DecodeState.FETCHING:
            return  # ended meanwhile (a cancelled wait_for still returns a result that was ready): moot
        self.requests.move(request.request_id, DecodeState.LANDED).verdict = status
        self.wake()

    def stats(self) -> StatsMsg:
        """The engine's figures, with the requests that wait for room in the KV cache counted as waiting
        and those whose KV is on its way as waiting deferred."""
        stats, queued = super().stats(), self.requests.count(DecodeState.QUEUED)
        moving = self.requests.count(DecodeState.FETCHING) + self.requests.count(DecodeState.LANDED)
        pd = PdStatsMsg(decode_prealloc=queued, decode_transfer=moving, num_bootstrap_failed=self.num_failed[0],
                        num_transfer_failed=self.num_failed[1])
        return msgspec.structs.replace(stats, num_waiting=stats.num_waiting + queued, num_waiting_deferred=moving, pd=pd)

    def holding(self) -> str | None:
        """The engine's requests, then those waiting for their KV or fenced, then quarantined blocks."""
        if (held := super().holding()) is not None:
            return held
        if len(self.requests):
            return f"{len(self.requests)} requests waiting for KV or fenced"
        quarantined = self.core.stats().num_quarantined_blocks
        return f"{quarantined} quarantined KV blocks" if quarantined else None

    def idle_wait_s(self, default_s: float) -> float:
        if self.requests.count(DecodeState.QUEUED):
            return 0.002
        # --kv-checksum: the pieces that land are digested as they come, not all after SUCCESS
        moving = self.config.kv_checksum and any(r.pending.ticket is None and r.pending.dst_block_ids
                                                 for r in self.requests.in_state(DecodeState.FETCHING))
        return 0.002 if moving else default_s

    async def poll(self) -> list[OutputMsg]:
        notes = self.backend.notifications()  # write tags: SUCCESS on the control stream is what counts
        if self.config.kv_checksum and notes:
            self.checks.digest_landed(notes, (r.pending for r in self.requests.in_state(DecodeState.FETCHING)))
        out = self._reserve_queued()
        for request_id in self.fences.take():
            self.requests.drop(request_id, fenced=True)
            self.core.release(request_id)
        for request in self.requests.in_state(DecodeState.FETCHING, DecodeState.LANDED):
            if self._ended(request.request_id):  # the engine failed it (and answered it): stop waiting, fence
                self._end_pending(request, "the decode engine failed the request")
        for request in self.requests.in_state(DecodeState.LANDED):
            status = request.verdict
            if isinstance(status, TransferStatusMsg) and status.state is TransferState.SUCCESS:
                mismatch = self._checksum(request, status)
                if mismatch is not None:
                    out += self._fail(request, mismatch)
                elif self._at_pace():  # its KV stays in its blocks; it starts once a running request ends
                    request.pending.checked = True
                else:
                    self._admit(request, status)
            else:
                out += self._fail(request, status)
        # An admitted request's first token (it came with the KV) goes out now, not with the next
        # decode step's token: the client sees it as soon as it reached us.
        return out + [self._with_kv_stats(msg) for msg in self._convert(self.core.take_outputs())]

    def _checksum(self, request: DecodeRequest, status: TransferStatusMsg) -> ChecksumMismatch | None:
        """With --kv-checksum, why what landed (or what we read) is not what the prefill wrote, if it is not."""
        pending = request.pending
        if not self.config.kv_checksum or not pending.dst_block_ids or pending.checked:
            return None
        return self.checks.check(pending, status)

    def _admit(self, request: DecodeRequest, status: TransferStatusMsg) -> None:
        request_id, pending = request.request_id, request.pending
        if not self._flow(pending).admit(request_id, pending, status):
            self.requests.drop(request_id)  # the engine ended the request meanwhile and already answered it
            return
        wait_s = time.monotonic() - pending.started
        self.requests.move(request_id, DecodeState.ADMITTED).kv_stats = KVStatsMsg(
            transfer_s=pending.read_s, kv_bytes=status.num_bytes, kv_wait_s=wait_s)
        log.info("kv received", request_id=request_id, bootstrap_room=pending.room, kv_bytes=status.num_bytes,
                 wait_s=round(wait_s, 6))

    def _ended(self, request_id: str) -> bool:
        progress = self.core.request_progress(request_id)
        return progress is None or progress.finished

    def step(self) -> list[OutputMsg]:
        self._apply_limits()  # from the requests running now: some may have ended (or been aborted) since
        out = [self._with_kv_stats(msg) for msg in super().step()]
        self._follow_pace()
        return out

    def _follow_pace(self) -> None:
        """After each step the pace saw: its cap (the scheduler follows it before the next step); logged
        when it moved, at most every PACE_LOG_INTERVAL_S with the moves since (exploring moves it by one,
        up and back, several times a second)."""
        steps, limits = self.core.steps, self.limits
        if limits.pace is None or steps.num_added == self._steps_seen:
            return
        self._steps_seen = steps.num_added
        limits.add_step(steps.last)
        now = time.monotonic()
        if limits.moves and now - self._pace_logged_at >= PACE_LOG_INTERVAL_S:
            fit = limits.pace.fit() or (0.0, 0.0, 0.0)
            log.info("decode pace", requests=limits.allowed(), moves=limits.moves, step_ms=round(fit[0] * 1e3, 1),
                     request_ms=round(fit[1] * 1e3, 1), prompt_token_ms=round(fit[2] * 1e3, 2),
                     objective_ms=self.config.decode.itl_objective_ms, sent_whole=limits.sent_whole)
            self._pace_logged_at, limits.moves = now, 0

    def _at_pace(self) -> bool:
        """--itl-objective-ms: a request whose KV landed waits while as many run as the pace allows."""
        return self.limits.at_pace(len(self.core.scheduler.running))

    def _with_kv_stats(self, msg: OutputMsg) -> OutputMsg:
        """An admitted request's first output carries its KV figures; then the role forgets it."""
        request = self.requests.get(msg.request_id)
        if request is None or request.state is not DecodeState.ADMITTED:
            return msg
        self.requests.drop(msg.request_id)
        return msgspec.structs.replace(msg, kv=request.kv_stats)

    def _fail(self, request: DecodeRequest, status) -> list[OutputMsg]:
        request_id = request.request_id
        if isinstance(status, TransferStatusMsg):
            reason = status.reason
        else:  # bad input reads as itself; anything else names its kind
            reason = status.message if isinstance(status, InvalidRequest) else f"{type(status).__name__}: {status}"
        unavailable = isinstance(status, PeerUnavailable) or getattr(status, "peer_lost", False)
        incompatible = isinstance(status, IncompatiblePeer)  # a router may pair it with another prefill
        corrupt = isinstance(status, ChecksumMismatch)  # another pair may move it whole
        code = 400 if isinstance(status, InvalidRequest) else 503 if unavailable or incompatible or corrupt else 500
        if not isinstance(status, InvalidRequest):  # SGLang's counts: the prefill not reached or refused us; else the KV
            self.num_failed[0 if isinstance(status, (PeerUnavailable, IncompatiblePeer)) else 1] += 1
        log.warning("decode request failed", request_id=request_id, reason=reason)
        self.core.abort(request_id, answer=False)  # the answer is ours, with the failure's status
        self._end_pending(request, reason)
        return [OutputMsg(request_id, finish_reason=FinishReason.ABORT, error=reason, error_status=code,
                          error_param=getattr(status, "param", None),
                          error_code=ErrorCode.INCOMPATIBLE_PEER if incompatible
                          else ErrorCode.KV_CHECKSUM_MISMATCH if corrupt else None)]

    async def abort(self, request_id: str) -> list[OutputMsg]:
        request = self.requests.get(request_id)
        if request is not None and request.state is DecodeState.QUEUED:  # nothing reserved yet
            self._drop_queued(request, "aborted on the decode side")
            return [OutputMsg(request_id, finish_reason=FinishReason.ABORT)]
        out = await super().abort(request_id)  # the engine ends it and quarantines its reserved blocks
        if request is None or request.state is DecodeState.FENCED:
            return out
        if request.state in (DecodeState.FETCHING, DecodeState.LANDED):
            self._end_pending(request, "aborted on the decode side")
        else:  # ADMITTED or LOCAL: the engine's own request, ended there
            self.requests.drop(request_id)
        return out

    def _end_pending(self, request: DecodeRequest, reason: str) -> None:
        """Stop waiting for a request's KV. The engine keeps its blocks quarantined; they are released
        once no write into them can land: at once when the flow says so, else when its fence ends."""
        request_id, pending = request.request_id, request.pending
        pending.task.cancel()
        if self._flow(pending).end(request_id, pending, reason):
            self.requests.drop(request_id)
            self.core.release(request_id)
        else:
            self.requests.move(request_id, DecodeState.FENCED)
