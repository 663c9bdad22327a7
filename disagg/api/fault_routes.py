"""POST /faults: a fault on one DP worker of this server, on purpose, for the tests of the routers and
clients in front of it (docs/testing.md). Only on a server started with `--enable-fault-injection`
(otherwise 404), and an admin route (the admin key, docs/security.md). Each fault is counted in
`disagg_faults_injected_total{fault, dp_rank}` and logged."""

from __future__ import annotations

import msgspec
import structlog
from aiohttp import web

from disagg.api.bodies import Int64, decode_body
from disagg.api.requests import read_body
from disagg.api.serving import json_response
from disagg.api.state import STATE, state_of
from disagg.dp.faults import check_fault

log = structlog.get_logger("disagg.api")


class FaultBody(msgspec.Struct, kw_only=True):
    fault: str
    dp_rank: Int64 = 0
    seconds: float | None = None
    count: Int64 | None = None
    status: Int64 | None = None
    ms: float | None = None


async def inject(request: web.Request) -> web.Response:
    """`{"fault": kind, "dp_rank": r, ...its parameters}` -> the fault as applied."""
    state = state_of(request)
    body = decode_body(await read_body(request), FaultBody)
    given = {name: getattr(body, name) for name in ("seconds", "count", "status", "ms")}
    kind, params = check_fault(body.fault, given)
    await state.engine.inject_fault(kind, body.dp_rank, params)
    state.metrics.faults.labels(body.fault, str(body.dp_rank)).inc()
    log.warning("fault injected", fault=body.fault, dp_rank=body.dp_rank, **params)
    return json_response({"fault": body.fault, "dp_rank": body.dp_rank, **params})


def add_routes(app: web.Application) -> None:
    """Register POST /faults when the server allows fault injection."""
    if app[STATE].config.enable_fault_injection:
        app.router.add_post("/faults", inject)
