"""Answer a generate request: pick the DP worker, run it, reply with JSON or an SSE stream.

Endpoints differ only in their Renderer (how totals and outputs become response bodies), so DP
routing, response headers, errors before and during a stream and aborts on disconnect behave the
same on every generate endpoint.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from contextlib import aclosing, contextmanager
from typing import Protocol

import msgspec
import structlog
from aiohttp import web

from disagg.api.admission import overload, ttft_overload
from disagg.api.errors import draining_error, overloaded_error, shutdown_error, to_api_error
from disagg.api.generation import Generation, Totals
from disagg.api.logging import bind_request
from disagg.api.sse import ClientGone, SSEWriter
from disagg.api.state import ApiState, state_of
from disagg.drain import Drain
from disagg.http_edge import HttpError
from disagg.wire.engine_msgs import GenerateMsg, OutputMsg
from disagg.wire.headers import DP_RANK_HEADER, KV_BYTES_HEADER, KV_WAIT_HEADER, REQUEST_ID_HEADER, ROLE_EPOCH_HEADER

log = structlog.get_logger("disagg.api")


class Renderer(Protocol):
    """How one endpoint shapes its answers."""

    def chunks(self, out: OutputMsg, totals: Totals) -> list[object]:
        """SSE payloads for one engine output (`totals` already include it); may be empty."""

    def tail(self, totals: Totals) -> list[object]:
        """SSE payloads after the finishing output (e.g. the usage chunk)."""

    def full(self, totals: Totals) -> object:
        """The non-streaming JSON body."""


def json_response(body: object, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """A JSON response encoded with msgspec."""
    return web.Response(body=msgspec.json.encode(body), status=status, content_type="application/json",
                        headers=headers)


async def serve_generation(request: web.Request, msg: GenerateMsg, routed_dp_rank: int | None,
                           renderer: Renderer, *, stream: bool) -> web.StreamResponse:
    """Run `msg` on the DP worker the engine picks and answer with `renderer`'s bodies.

    A draining server refuses the request (503), an overloaded one too (429); one the drain aborts
    ends with its shutdown error.
    """
    state = state_of(request)
    bind_request(msg.request_id, bootstrap_room=msg.bootstrap_room)
    admit(state, request.headers)
    with state.drain.track():
        dp_rank = state.engine.pick_rank(routed_dp_rank, msg.bootstrap_room, msg)
        structlog.contextvars.bind_contextvars(dp_rank=dp_rank)
        state.metrics.vllm.observe_n(dp_rank, 1)
        generation = Generation(state, msg, dp_rank, can_hand_back=True)
        headers = {DP_RANK_HEADER: str(dp_rank), REQUEST_ID_HEADER: msg.request_id}
        if stream:
            return await _stream(request, generation, renderer, headers, state.drain)
        with shutdown_if_drained(state.drain):
            totals = await generation.collect()
        return json_response(renderer.full(totals), headers={**headers, **kv_headers(totals)})


def kv_headers(totals) -> dict[str, str]:
    """A decode's answer whose KV came from a prefill: its wait for the KV and the bytes (known with
    the first output, so before a stream's headers go out)."""
    kv = totals.kv
    if kv is None or not kv.kv_wait_s:
        return {}
    return {KV_WAIT_HEADER: f"{kv.kv_wait_s * 1e3:.1f}", KV_BYTES_HEADER: str(kv.kv_bytes)}


def admit(state: ApiState, headers: Mapping[str, str]) -> None:
    """Refuse a new generate request at once: 503 while the server drains, switches its role (or was
    routed for a role epoch it left: `X-PD-Role-Epoch`), 429 (Retry-After) while it is overloaded: too
    many waiting, the KV caches full, or its first tokens late (api/admission.py)."""
    if state.drain.draining:
        raise draining_error(state.drain)
    if state.engine.pd_roles is not None:
        if (switching := state.engine.pd_roles.refusal_error()) is not None:
            raise switching  # 503 role_switching: a router sends it to another server
        if (stale := state.engine.pd_roles.stale_epoch_error(headers.get(ROLE_EPOCH_HEADER))) is not None:
            raise stale
    config = state.config
    refusal = ttft_overload(state.waits, config.ttft_objective_ms, time.monotonic())
    if refusal is None and (config.max_waiting_requests or config.max_kv_usage < 1.0):
        refusal = overload(state.engine.worker_states(), config.max_waiting_requests, config.max_kv_usage)
    if refusal is not None:
        state.metrics.refused.labels(refusal.code).inc()
        raise overloaded_error(refusal)


@contextmanager
def shutdown_if_drained(drain: Drain):
    """Before any byte went out: a cancellation the drain caused becomes its 503 shutdown error."""
    try:
        yield
    except asyncio.CancelledError:
        if not drain.claim_abort():
            raise
        raise shutdown_error(drain) from None


async def end_stream_if_drained(sse: SSEWriter, drain: Drain) -> None:
    """Mid-stream, in an `except CancelledError`: the drain's error event ends the stream, or the
    cancellation (not the drain's) goes on."""
    if not drain.claim_abort():
        raise  # the CancelledError being handled: not the drain's
    await _end_with_error(sse, shutdown_error(drain))


async def _stream(request: web.Request, generation: Generation, renderer: Renderer,
                  headers: dict[str, str], drain: Drain) -> web.StreamResponse:
    async with aclosing(generation.outputs()) as outputs:
        # Wait for the first output before sending headers: a request the worker rejects at once
        # (bad prompt, sleeping engine) gets its real HTTP status instead of a 200 stream.
        with shutdown_if_drained(drain):
            first = await anext(outputs, None)
        sse = SSEWriter({**headers, **kv_headers(generation.totals)})
        try:
            await sse.start(request)
            await _pump(sse, renderer, generation.totals, first, outputs)
            await sse.done()
        except ClientGone:
            log.info("client disconnected mid-stream; aborting the request")
        except asyncio.CancelledError:
            await end_stream_if_drained(sse, drain)
    return sse.response


async def _end_with_error(sse: SSEWriter, err: HttpError) -> None:
    """One error event, then `[DONE]`; a client that already left is not an error."""
    log.warning("request aborted mid-stream", status=err.status, error=err.message)
    try:
        await sse.send_error(err)
        await sse.done()
    except ClientGone:
        pass


async def _pump(sse: SSEWriter, renderer: Renderer, totals: Totals, first: OutputMsg | None, outputs) -> None:
    """Send every output's chunks, then the tail; a failure becomes one error event."""
    try:
        if first is not None:
            await sse.send_all(renderer.chunks(first, totals))
        async for out in outputs:
            await sse.send_all(renderer.chunks(out, totals))
        await sse.send_all(renderer.tail(totals))
    except ClientGone:
        raise
    except Exception as exc:  # noqa: BLE001 - the request failed mid-stream: tell the client, end cleanly
        err = to_api_error(exc)
        log.warning("request failed mid-stream", status=err.status, error=err.message)
        await sse.send_error(err)
