"""Admin routes: health probes, server and model info (SGLang's names too), metrics, aborts."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import uuid

import msgspec
from aiohttp import web

from disagg import __version__
from disagg.api.bodies import decode_body
from disagg.api.errors import API_EDGE, draining_error
from disagg.api.generation import hand_back_unanswered
from disagg.api.serving import json_response
from disagg.api.state import ApiState, state_of
from disagg.config import DisaggregationMode
from disagg.dp.protocol import EngineClient
from disagg.http_edge import BadRequest, HttpError
from disagg.types import SamplingParams
from disagg.wire.engine_msgs import GenerateMsg

HEALTH_GENERATE_TIMEOUT_S = 30.0


class AbortBody(msgspec.Struct, kw_only=True):
    """SGLang's abort body (one rid or a list of them, or `abort_all`) or vLLM's (`request_ids`)."""

    rid: str | list[str] | None = None
    abort_all: bool | None = None
    request_ids: list[str] | None = None


def _listed(down) -> str:
    return ", ".join(f"dp_rank {s.dp_rank} {'not ready' if s.alive else 'dead'}" for s in down) or "reason unknown"


async def health(request: web.Request) -> web.Response:
    """GET /health: 200 with an empty body when every DP worker is ready; 200 with a `degraded`
    JSON body naming the workers that are down while at least one serves (dead workers restart on
    their own: keep the server in rotation); 503 when none can serve or while draining (docs/faults.md)."""
    state = state_of(request)
    if state.drain.draining:
        return API_EDGE.response(draining_error(state.drain))
    engine = state.engine
    if engine.pd_roles is not None and (switching := engine.pd_roles.refusal_error()) is not None:
        return API_EDGE.response(switching)  # switching now, or failed: never serve half-switched
    if engine.healthy():
        return web.Response(status=200)
    states = engine.worker_states()
    down = [s for s in states if not (s.alive and s.ready)]
    if len(down) < len(states):
        return json_response({"status": "degraded", "message": f"DP workers down: {_listed(down)}",
                              "dp_ranks_down": [s.dp_rank for s in down]})
    return API_EDGE.response(HttpError(503, f"engine is not healthy ({_listed(down)})"))


async def _probe(engine: EngineClient, dp_rank: int) -> str | None:
    """One 1-token greedy generation on `dp_rank`; None when it finished, else what went wrong."""
    msg = GenerateMsg(request_id=f"health-generate-{uuid.uuid4().hex}", prompt_token_ids=[0],
                      sampling=SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    stream = engine.generate(msg, dp_rank)
    try:
        async for out in stream:
            if out.error is not None:
                return out.error
            if out.finish_reason is not None:
                return None
        return "the generation ended without a finish reason"
    finally:
        if hasattr(stream, "aclose"):
            await stream.aclose()


async def _probe_in_time(engine: EngineClient, dp_rank: int) -> str | None:
    try:
        return await asyncio.wait_for(_probe(engine, dp_rank), HEALTH_GENERATE_TIMEOUT_S)
    except asyncio.TimeoutError:
        return f"no token within {HEALTH_GENERATE_TIMEOUT_S:g} s"
    except Exception as exc:  # noqa: BLE001 - a probe reports failures, it does not raise them
        return f"{type(exc).__name__}: {exc}"


async def health_generate(request: web.Request) -> web.Response:
    """GET /health_generate: a 1-token generation on every DP worker (unified servers).

    Prefill and decode servers cannot generate without their peer, so there it equals /health.
    """
    state = state_of(request)
    engine = state.engine
    if engine.mode is not DisaggregationMode.NULL or not engine.healthy() or state.drain.draining:
        return await health(request)
    failures = await asyncio.gather(*(_probe_in_time(engine, r) for r in range(engine.dp_size)))
    listed = ", ".join(f"dp_rank {r}: {f}" for r, f in enumerate(failures) if f is not None)
    if listed:
        return API_EDGE.response(HttpError(503, f"health generation failed ({listed})"))
    return web.Response(status=200)


def _server_info(state: ApiState) -> dict:
    card, engine = state.engine.model, state.engine
    info = {
        "model_path": card.name, "served_model_name": card.name, "max_model_len": card.max_model_len,
        "vocab_size": card.vocab_size, "engine": card.engine_summary, "dp_size": engine.dp_size,
        "load_balance_method": engine.load_balance_method, "disaggregation_mode": engine.mode,
        "internal_states": [dataclasses.asdict(s) for s in engine.worker_states()], **engine.role_info,
    }
    if "kv_compatibility" in info:  # a P/D server: the engine's record and its role's transfer settings
        info["kv_compatibility"] = {**card.compatibility, **info["kv_compatibility"]}
    return info


async def server_info(request: web.Request) -> web.Response:
    """GET /server_info (and SGLang's /get_server_info)."""
    return json_response(_server_info(state_of(request)))


async def model_info(request: web.Request) -> web.Response:
    """GET /model_info (and SGLang's /get_model_info)."""
    card = state_of(request).engine.model
    return json_response({"model_path": card.name, "tokenizer_path": card.name, "served_model_name": card.name,
                          "is_generation": True, "max_model_len": card.max_model_len, "vocab_size": card.vocab_size})


async def metrics(request: web.Request) -> web.Response:
    """GET /metrics: Prometheus text, the workers' gauges as they are now."""
    await state_of(request).engine.refresh_stats()
    registry = state_of(request).metrics
    return web.Response(body=registry.render(), headers={"Content-Type": registry.content_type})


async def get_load(request: web.Request) -> web.Response:
    """GET /get_load: SGLang's load report, one entry per DP worker, as sgl-model-gateway's load
    policies read it (they sum `num_tokens`). `num_tokens` counts the KV tokens the worker holds
    (blocks not free times the block size); `num_reqs` its running and waiting requests."""
    return json_response([
        {"dp_rank": s.dp_rank, "num_reqs": s.num_running + s.num_waiting, "num_waiting_reqs": s.num_waiting,
         "num_tokens": (s.num_total_blocks - s.num_free_blocks) * s.block_size}
        for s in state_of(request).engine.worker_states()
    ])


async def load(request: web.Request) -> web.Response:
    """GET /load (vLLM's, with --enable-server-load-tracking there; always on here): the generate
    requests this server is serving now."""
    return json_response({"server_load": state_of(request).drain.num_in_flight})


async def version(request: web.Request) -> web.Response:
    """GET /version: `{"version": ...}` (vLLM's route), the disagg package version."""
    return json_response({"version": __version__})


async def abort_requests(request: web.Request) -> web.Response:
    """POST /abort_request(s): `{"rid": ...}`, vLLM's `{"request_ids": [...]}` or `{"abort_all": true}`;
    answers the ids it found."""
    state = state_of(request)
    raw = await request.read()
    body = decode_body(raw, AbortBody) if raw.strip() else AbortBody()
    if body.abort_all:
        rids = list(state.inflight)
    elif body.rid or body.request_ids:
        rids = ([body.rid] if isinstance(body.rid, str) else body.rid or []) + (body.request_ids or [])
    else:
        raise BadRequest("send a rid, request_ids or abort_all: true", "rid")
    found = [rid for rid in rids if await state.engine.abort(rid)]
    return json_response({"aborted": found})


class RoleSwitchBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    new_role: str


async def pd_role_switch(request: web.Request) -> web.Response:
    """POST /pd_role_switch `{"new_role": "prefill"|"decode"}` (an admin route; servers started with
    --enable-pd-role-switch): the whole server, every DP worker, switches once the work it accepted
    has ended (disagg/dp/role_switch.py). 200 with the new mode and epoch (`switched` false when it
    ran that role already); 400 bad body or switching off; 409 another switch runs or one failed;
    503 the accepted work did not end in time (the server goes on as it was); 500 failed halfway."""
    state = state_of(request)
    body = decode_body(await request.read(), RoleSwitchBody)
    if body.new_role not in (DisaggregationMode.PREFILL.value, DisaggregationMode.DECODE.value):
        raise BadRequest(f"new_role must be prefill or decode, got {body.new_role!r}", "new_role")
    timeout_s = state.config.pd_role_switch_timeout_s
    # Counted from admission on: a request admitted but not yet sent to a worker is waited for too.
    switched = await state.engine.switch_role(DisaggregationMode(body.new_role), timeout_s,
                                              lambda: state.drain.num_in_flight,
                                              functools.partial(hand_back_unanswered, state))
    return json_response({"success": True, "switched": switched, "disaggregation_mode": state.engine.mode,
                          "pd_role_epoch": state.engine.pd_roles.epoch})


def add_routes(app: web.Application) -> None:
    """Register the admin routes on `app`."""
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health_generate)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, server_info)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, model_info)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/get_load", get_load)
    app.router.add_get("/load", load)
    app.router.add_get("/version", version)
    for path in ("/abort_request", "/abort_requests"):
        app.router.add_post(path, abort_requests)
    app.router.add_post("/pd_role_switch", pd_role_switch)
