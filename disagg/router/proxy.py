"""P/D dispatch of one generate request: pick a pair, add the bootstrap fields, send the same body
to both servers at once, and answer with the decode's response (whole or streamed). With
`--protocol pull` (vLLM's): the prefill first, with `kv_transfer_params.do_remote_decode`; then the
decode, with the prefill's ticket.

The first leg to fail cancels the other and its error is the answer. A prefill that fails after the
decode's stream has started ends the stream with one error event and `data: [DONE]`. A server that
answers 503 `draining` (it is shutting down) is skipped: the request goes to another pair. A 429
(the server is overloaded) goes to another pair when the refusing server's role has another server;
else the client gets the 429 with its Retry-After at once.
"""

from __future__ import annotations

import asyncio
import random
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import msgspec
import structlog
from aiohttp import web

from disagg.drain import Drain
from disagg.http_edge import HttpError
from disagg.router import bodies, local_prefill, traces
from disagg.router.config import PdProtocol, PrefillEndpoint, RouterConfig
from disagg.router.errors import (
    RequestShutDown, ServerDraining, ServerError, ServerUnreachable, retryable, sse_error_event,
)
from disagg.router.health import HealthChecker
from disagg.router.answer_path import LOCAL_PREFILL_REFUSED, answer_path, failure_reason
from disagg.router.compat import pool_pair
from disagg.router.legs import (
    Leg, LegAnswer, LegClient, await_unless_other_fails, both_or_first_error, cancel_all, json_or_none, stream_headers,
)
from disagg.router.metrics import RouterMetrics
from disagg.router.policy import PairPolicy, Policy, draw_rooms, pick_dp_rank
from disagg.router.workers import Health, Role, WorkerPool
from disagg.tracing import annotate, since_start_ms, step
from disagg.types import ErrorCode
from disagg.wire.headers import (
    DP_RANK_HEADER, KV_WAIT_HEADER, PATH_HEADER, PATH_REASON_HEADER, REQUEST_ID_HEADER, RETRIES_HEADER, ROLE_EPOCH_HEADER,
)

log = structlog.get_logger("disagg.router")
REFUSED = "refused a request with 503"  # `last_error` of a server found draining (or switching roles) that way
# Request headers both legs receive; everything else (Host, Content-Length, ...) is the router's own.
PULL_REQUEST = {"do_remote_decode": True, "do_remote_prefill": False}  # what vLLM's router sends the prefill
FORWARDED_HEADERS = ("Authorization", DP_RANK_HEADER, REQUEST_ID_HEADER, "traceparent", "tracestate")


@dataclass(frozen=True)
class Plan:
    """Everything decided about one request before any byte is sent."""

    prefill: Leg | None  # None: the decode prefills the request itself (--max-local-prefill-tokens)
    decode: Leg
    room: int | list[int]
    stream: bool
    merge_logprobs: bool
    expected_decode_rank: int | None  # external-DP-routing test mode only
    learn: Callable[[bytes], None] | None = None  # records the decode's answer in its tree (local prefill)
    whole: bool = False  # no prefill serves: the decode prefills the whole prompt (disagg_prefill_here)


def forwarded_headers(headers: Mapping[str, str], drop_dp_rank: bool) -> dict[str, str]:
    """The client's headers that go to both legs, plus the JSON content type."""
    out = {"Content-Type": "application/json"}
    for name in FORWARDED_HEADERS:
        if name == DP_RANK_HEADER and drop_dp_rank:
            continue  # untrusted, or the test mode pins ranks itself (a header would override them on both legs)
        if name in headers:
            out[name] = headers[name]
    return out


class Proxy:
    """Dispatches generate requests over one LegClient; owns no connections itself."""

    def __init__(self, config: RouterConfig, pool: WorkerPool, health: HealthChecker, legs: LegClient,
                 picker: PairPolicy, rng: random.Random | None = None,
                 randbits: Callable[[int], int] = secrets.randbits, drain: Drain | None = None,
                 metrics: RouterMetrics | None = None):
        self._config = config
        self._drain = drain if drain is not None else Drain("router")
        self._pool = pool
        self._health = health
        self._legs = legs
        self._picker = picker
        self._rng = rng if rng is not None else random.Random()
        self._randbits = randbits
        self._metrics = metrics if metrics is not None else RouterMetrics()

    async def serve(self, request: web.Request, path: str, raw: bytes | None = None) -> web.StreamResponse:
        """Answer one generate request (`path` is the same on both servers; `raw`: its body, else the request's).

        A server that refuses because it is draining is marked unhealthy and the request goes to
        another pair (a new room; the cancelled legs abort the old one). A request the router's own
        drain aborts ends with its shutdown error.
        """
        trusted = self._config.trust_client_routing
        body = bodies.without_internal_fields(bodies.parse_request_body(raw or await request.read()), trusted)
        headers = forwarded_headers(request.headers, self._config.test_external_dp_routing or not trusted)
        try:
            return await self._serve_with_retries(request, path, body, headers)
        except asyncio.CancelledError:
            if not self._drain.claim_abort():
                raise
            raise RequestShutDown(self._drain.abort_message()) from None
        except HttpError as exc:
            (log.warning if exc.status >= 500 else log.info)("request failed", status=exc.status, error=exc.message)
            raise

    async def _serve_with_retries(self, request: web.Request, path: str, body: dict,
                                  headers: dict[str, str]) -> web.StreamResponse:
        """Serve on a fresh pair and room again when a leg failed before any byte reached the client:
        a draining server (marked unhealthy; every refusal marks one more, so the tries are bounded by
        the servers), a retryable failure (at most `retry_max_retries` times), or a decode that would
        not prefill the request itself (once more, with a prefill)."""
        num_draining = self._pool.size(Role.PREFILL) + self._pool.size(Role.DECODE)
        num_retries, first_failure = 0, None
        local_ok = True
        while True:
            try:
                with step("router.pick"):
                    plan = await self.plan(path, body, local_ok, headers)
                return await self._serve_plan(request, path, plan, headers, num_retries, first_failure)
            except local_prefill.LocalPrefillRefused as exc:
                log.info("the decode would not prefill the request itself; sending it with a prefill", error=exc.message)
                self._metrics.local_prefills_refused.inc()
                local_ok, first_failure = False, first_failure or LOCAL_PREFILL_REFUSED
            except ServerDraining as exc:
                first_failure = first_failure or failure_reason(exc)
                log.info("server takes no new requests; sending the request elsewhere", role=exc.role, url=exc.url,
                         code=exc.code.value)
                self._pool.set_health(Role(exc.role), exc.index, Health.UNHEALTHY, f"{REFUSED} ({exc.code.value})")
                if exc.code is not ErrorCode.DRAINING:  # it switches roles: follow it closely until it serves
                    self._health.watch(Role(exc.role), exc.index)
                num_draining -= 1
                if num_draining <= 0:
                    raise
            except (ServerError, ServerUnreachable) as exc:
                others = self._pool.size(Role(exc.role))
                first_failure = first_failure or failure_reason(exc)
                if not retryable(exc, others) or num_retries >= self._config.retry_max_retries:
                    if num_retries:
                        self._metrics.retries_exhausted.labels(path).inc()
                    raise
                num_retries += 1
                self._metrics.retries.labels(path).inc()
                log.warning("a leg failed before any byte reached the client; sending the request again",
                            status=exc.status, error=exc.message, retry=num_retries)

    async def _serve_plan(self, request: web.Request, path: str, plan: Plan, headers: dict[str, str],
                          num_retries: int = 0, first_failure: str | None = None) -> web.StreamResponse:
        room = plan.room if isinstance(plan.room, int) else plan.room[0]
        with structlog.contextvars.bound_contextvars(bootstrap_room=room, path=path):
            try:
                log.debug("request routed", prefill=plan.prefill and plan.prefill.server, decode=plan.decode.server)
                prefill = None
                if plan.prefill is None:  # the decode prefills it itself: a prefill leg that is already done
                    prefill = asyncio.get_running_loop().create_future()
                    prefill.set_result(None)
                elif self._config.protocol is PdProtocol.PULL:
                    plan, prefill = await self._pull_ticket(plan, headers)
                taken, why = answer_path(plan.prefill is None, first_failure, plan.whole)
                out_headers = {PATH_HEADER: taken.value, **({PATH_REASON_HEADER: why} if why else {}),
                               **({RETRIES_HEADER: str(num_retries)} if num_retries else {})}
                answer = await (self._stream(request, plan, headers, prefill, out_headers) if plan.stream
                                else self._unary(plan, headers, prefill, out_headers))
                self._metrics.record_answer(taken.value, why, answer.headers.get(KV_WAIT_HEADER))
                annotate(disaggregation_used=plan.prefill is not None, reason=why or taken.value, bootstrap_room=room,
                         prefill=plan.prefill and plan.prefill.server, decode=plan.decode.server, retries=num_retries)
                log.info("request answered", disagg_path=taken.value, reason=why, retries=num_retries,
                         prefill=plan.prefill and plan.prefill.server, decode=plan.decode.server,
                         kv_wait_ms=answer.headers.get(KV_WAIT_HEADER))
                return answer
            except ServerError as exc:
                if plan.prefill is None and not plan.whole and local_prefill.refuses_local_prefill(exc):
                    raise local_prefill.LocalPrefillRefused(exc) from None
                raise
            finally:
                self._end(plan)

    async def plan(self, path: str, body: dict, local_ok: bool = True, headers: dict[str, str] | None = None) -> Plan:
        """Pick the pair, draw the room, and build each leg's body. The pair counts as busy from the
        pick on (the caller ends it), so discovery cannot forget a server this request will use. A
        request the decode prefills itself (`local_ok` and the policy says so) has no prefill leg."""
        text = bodies.routing_text(path, body) if self._picker.uses_text else ""
        if self._config.policy is Policy.CACHE_AWARE:  # each decode's local-prefill limit, from its /server_info
            await self._health.ensure_server_infos(Role.DECODE)
        prefill_loads = self._pool.loads(Role.PREFILL)
        token_ids = await self._routing_tokens(path, body, text, prefill_loads, headers)
        pick = self._picker.pick(prefill_loads, self._pool.loads(Role.DECODE), text, local_ok, token_ids)
        self._metrics.record_pick(pick)
        d = self._pool.ids(Role.DECODE)[pick.decode]
        if not pick.local:  # a pair whose records differ is never used: a compatible one, or a 503 that says why
            p, d = pool_pair(self._pool, self._pool.ids(Role.PREFILL)[pick.prefill], d)
            if p != self._pool.ids(Role.PREFILL)[pick.prefill]:
                pick = replace(pick, prefill=self._pool.ids(Role.PREFILL).index(p), prefill_dp_rank=None)
        self._metrics.picks.labels("decode", self._pool.info(Role.DECODE, d).url).inc()
        learn = local_prefill.learner(self._picker, path, text, d, bodies.is_stream(body))
        if pick.local:
            self._pool.begin(Role.DECODE, d)
            decode_url = self._pool.info(Role.DECODE, d).url
            decode_body = {**body, "disagg_prefill_here": True} if pick.whole else body
            decode = Leg(Role.DECODE, d, decode_url, decode_url + path, bodies.encode_body(decode_body),
                         self._epoch(Role.DECODE, d))
            return Plan(prefill=None, decode=decode,
                        room=0, stream=bodies.is_stream(body), merge_logprobs=False, expected_decode_rank=None,
                        learn=learn, whole=pick.whole)
        p = self._pool.ids(Role.PREFILL)[pick.prefill]
        self._metrics.picks.labels("prefill", self._pool.info(Role.PREFILL, p).url).inc()
        self._pool.begin(Role.PREFILL, p)
        self._pool.begin(Role.DECODE, d)
        try:
            return replace(await self._plan_pair(path, body, p, d, pick.prefill_dp_rank), learn=learn)
        except BaseException:
            self._pool.end(Role.PREFILL, p)
            self._pool.end(Role.DECODE, d)
            raise

    async def _routing_tokens(self, path: str, body: dict, text: object, loads,
                              headers: dict[str, str] | None) -> tuple[int, ...] | None:
        """The prompt's token ids for the KV-event index, once every prefill publishes: given, or from
        an eligible prefill's /tokenize (None when it cannot tell: the trees decide then)."""
        if not self._picker.wants_token_ids(loads):
            return None
        if isinstance(text, tuple):
            return text
        tokenize = bodies.tokenize_body(path, body)
        server = next((self._pool.info(Role.PREFILL, load.server_id).url for load in loads if load.eligible), None)
        if tokenize is None or server is None:
            return None
        tokens = await self._legs.tokenize(server, tokenize, headers or {"Content-Type": "application/json"})
        return None if tokens is None else tuple(tokens)

    async def _plan_pair(self, path: str, body: dict, p: int, d: int, p_rank: int | None) -> Plan:
        """The legs of the pair; `p_rank` is the prefill DP rank the policy pinned (cache_aware), if any."""
        prefill = self._pool.info(Role.PREFILL, p)
        decode_url = self._pool.info(Role.DECODE, d).url
        endpoint = PrefillEndpoint(prefill.url, prefill.bootstrap_port, prefill.registry_host)
        room = draw_rooms(bodies.generate_batch_size(path, body), self._randbits)
        shared = bodies.with_bootstrap(body, bodies.Bootstrap(endpoint.bootstrap_host, endpoint.bootstrap_port, room))
        expected = None
        if self._config.test_external_dp_routing:
            if p_rank is None:
                p_rank = pick_dp_rank(await self._health.ensure_dp_size(Role.PREFILL, p), self._rng)
            expected = pick_dp_rank(await self._health.ensure_dp_size(Role.DECODE, d), self._rng)
            prefill_body, decode_body = (bodies.encode_body(b) for b in bodies.with_dp_ranks(shared, p_rank, expected))
        elif self._config.protocol is PdProtocol.PULL:
            pinned = {} if p_rank is None else {"routed_dp_rank": p_rank}
            prefill_body = bodies.encode_body(dict(body, stream=False, kv_transfer_params=PULL_REQUEST, **pinned))
            decode_body = bodies.encode_body(body)
        elif p_rank is not None:
            prefill_body, decode_body = (bodies.encode_body(b) for b in bodies.with_dp_ranks(shared, p_rank, None))
        else:
            prefill_body = decode_body = bodies.encode_body(shared)
        return Plan(
            prefill=Leg(Role.PREFILL, p, endpoint.url, endpoint.url + path, prefill_body, self._epoch(Role.PREFILL, p)),
            decode=Leg(Role.DECODE, d, decode_url, decode_url + path, decode_body, self._epoch(Role.DECODE, d)),
            room=room, stream=bodies.is_stream(body), merge_logprobs=bodies.wants_prompt_logprobs(path, body),
            expected_decode_rank=expected,
        )

    def _epoch(self, role: Role, index: int) -> tuple[tuple[str, str], ...]:
        """A server that may switch roles is told the role epoch it was picked at (X-PD-Role-Epoch): one
        that switched since refuses (503 stale_role_epoch) rather than serve the other half."""
        epoch = self._pool.info(role, index).role_epoch
        return () if epoch is None else ((ROLE_EPOCH_HEADER, str(epoch)),)

    def _end(self, plan: Plan) -> None:
        if plan.prefill is not None:
            self._pool.end(Role.PREFILL, plan.prefill.index)
        self._pool.end(Role.DECODE, plan.decode.index)

    async def _pull_ticket(self, plan: Plan, headers: dict[str, str]) -> tuple[Plan, asyncio.Future]:
        """Pull flow: the prefill's answer, and the plan whose decode leg carries its ticket."""
        answer = await self._fetch_prefill(plan, headers)
        ticket = (json_or_none(answer.body) or {}).get("kv_transfer_params")
        if not isinstance(ticket, dict):
            raise HttpError(502, f"prefill server {plan.prefill.server} answered without kv_transfer_params "
                                 "(is it a prefill server that speaks the pull flow?)")
        decode_body = dict(msgspec.json.decode(plan.decode.body), kv_transfer_params=ticket)
        done = asyncio.get_running_loop().create_future()
        done.set_result(answer)
        return replace(plan, decode=replace(plan.decode, body=bodies.encode_body(decode_body))), done

    async def _fetch_prefill(self, plan: Plan, headers: dict[str, str]) -> LegAnswer:
        """The prefill leg, counted as prefilling on its server until it answers (the prefill's queue
        for --local-prefill-min-prefill-load)."""
        self._pool.begin_prefill(plan.prefill.index)
        try:
            with step("router.prefill_leg", {"server": plan.prefill.server}):
                answer = await self._legs.fetch(plan.prefill, headers)
            annotate(prefill_duration_ms=since_start_ms())
            return answer
        finally:
            self._pool.end_prefill(plan.prefill.index)

    async def _unary(self, plan: Plan, headers: dict[str, str], prefill: asyncio.Future | None = None,
                     out_headers: dict[str, str] | None = None) -> web.Response:
        prefill = prefill or asyncio.create_task(self._fetch_prefill(plan, headers))
        decode = asyncio.create_task(self._legs.fetch(plan.decode, headers))
        prefill_answer, decode_answer = await both_or_first_error(prefill, decode)
        traces.first_byte()
        body = self._decode_body(plan, prefill_answer, decode_answer)
        if plan.learn is not None:
            plan.learn(decode_answer.body)
        out_headers = {**(out_headers or {}), "Content-Type": decode_answer.content_type, **decode_answer.passed}
        return web.Response(body=body, status=decode_answer.status, headers=out_headers)

    def _decode_body(self, plan: Plan, prefill: LegAnswer, decode: LegAnswer) -> bytes:
        """The decode's bytes as they are, unless the DP check or a logprob merge must read them."""
        if plan.expected_decode_rank is None and not plan.merge_logprobs:
            return decode.body
        try:
            answer = msgspec.json.decode(decode.body)
        except msgspec.DecodeError:
            if plan.expected_decode_rank is not None:
                raise HttpError(502, f"decode server {plan.decode.server} answered invalid JSON") from None
            return decode.body
        if plan.expected_decode_rank is not None:
            bodies.check_decode_dp_rank(plan.expected_decode_rank, answer, decode.passed.get(DP_RANK_HEADER))
        if plan.merge_logprobs and bodies.merge_prompt_logprobs(answer, json_or_none(prefill.body)):
            return msgspec.json.encode(answer)
        return decode.body

    async def _stream(self, request: web.Request, plan: Plan, headers: dict[str, str],
                      prefill: asyncio.Future | None = None, out_headers: dict[str, str] | None = None) -> web.StreamResponse:
        prefill = prefill or asyncio.create_task(self._fetch_prefill(plan, headers))
        opening = asyncio.create_task(self._legs.open_stream(plan.decode, headers))
        resp = None
        try:
            resp, first = await await_unless_other_fails(opening, prefill)
            traces.first_byte()
            reported = resp.headers.get(DP_RANK_HEADER)
            if plan.expected_decode_rank is not None and reported is not None:
                bodies.check_decode_dp_rank(plan.expected_decode_rank, None, reported)
            out = web.StreamResponse(status=resp.status, headers={**(out_headers or {}), **stream_headers(resp.headers)})
            await out.prepare(request)
            kept = [] if plan.learn is not None else None  # the answer's events, to learn it once it ends well
            await self._relay_unless_aborted(out, plan, resp, first, prefill, kept)
            await out.write_eof()
            if kept and len(kept) < local_prefill.MAX_ANSWER_CHUNKS:
                plan.learn(b"".join(kept))
            try:
                await self._settle_prefill(prefill)
            except asyncio.CancelledError:  # the client has its whole answer; stop waiting for the prefill
                if not self._drain.claim_abort():
                    raise
            return out
        finally:
            await cancel_all([prefill, opening])
            if resp is not None:
                resp.close()

    async def _relay_unless_aborted(self, out: web.StreamResponse, plan: Plan, resp, first: bytes,
                                    prefill: asyncio.Task, kept: list[bytes] | None) -> None:
        """`_relay`; when the router's drain aborts the request, the stream ends with its error event."""
        try:
            await self._relay(out, plan, resp, first, prefill, kept)
        except asyncio.CancelledError:
            if kept is not None:
                kept.clear()
            if not self._drain.claim_abort():
                raise
            err = RequestShutDown(self._drain.abort_message())
            log.warning("request aborted mid-stream", status=err.status, error=err.message)
            await out.write(sse_error_event(err))

    async def _relay(self, out: web.StreamResponse, plan: Plan, resp, first: bytes, prefill: asyncio.Task,
                     kept: list[bytes] | None = None) -> None:
        """Copy the decode's chunks to the client in order (into `kept` too, up to its bound; emptied on a
        failure); end with an error event if a leg fails."""
        chunk = first
        try:
            while chunk:
                await out.write(chunk)
                if kept is not None and len(kept) < local_prefill.MAX_ANSWER_CHUNKS:
                    kept.append(chunk)
                if prefill.done() and prefill.exception() is None:  # nothing left to watch
                    chunk = await self._legs.read_chunk(plan.decode, resp)
                    continue
                chunk = await await_unless_other_fails(
                    asyncio.create_task(self._legs.read_chunk(plan.decode, resp)), prefill)
        except HttpError as exc:
            log.warning("stream failed after it started", status=exc.status, error=exc.message)
            if kept is not None:
                kept.clear()
            await out.write(sse_error_event(exc))

    async def _settle_prefill(self, prefill: asyncio.Task) -> None:
        """The decode is done: wait for the prefill's answer (within the request timeout); log a late failure."""
        done, _ = await asyncio.wait({prefill}, timeout=self._legs.timeout_s)
        if prefill in done and not prefill.cancelled() and prefill.exception() is not None:
            log.warning("prefill failed after the decode finished", error=str(prefill.exception()))
