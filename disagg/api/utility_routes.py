"""Engine utilities fanned out to every DP worker and aggregated (docs/api.md: the routes table, and the errors of a disagreement).

`/is_sleeping` needs every worker to agree (else 500 InconsistentUtilityResults listing each value);
`/reset_prefix_cache` needs every worker to answer True, `/sleep` and `/wake_up` need no worker to
answer False (they answer None); the error names the workers that failed. No worker answering is an
error too.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from disagg.api.bodies import decode_body
from disagg.api.serving import json_response
from disagg.api.state import state_of
from disagg.dp.aggregate import all_agree, all_true
from disagg.dp.protocol import EngineClient, UtilityFailed
from disagg.http_edge import BadRequest, HttpError
from disagg.wire.engine_msgs import Utility

SLEEP_LEVELS = (1, 2)


class SleepBody(msgspec.Struct, kw_only=True):
    """`{"level": 1 | 2}` (the query parameter `level` wins)."""

    level: int | None = None


async def fan_out(engine: EngineClient, method: Utility, *args: object) -> list[object]:
    """One result per DP worker; an empty list is an error, never an index crash."""
    results = await engine.call_utility(method, *args)
    if not results:
        raise HttpError(500, f"{method}: no DP worker answered", error_type="UtilityFailed")
    return list(results)


def require_all_succeeded(method: str, results: list[object]) -> None:
    """For calls whose workers answer None on success: any worker that answered False fails the call."""
    failures = {rank: "returned False" for rank, result in enumerate(results) if result is False}
    if failures:
        raise UtilityFailed(method, failures)


async def is_sleeping(request: web.Request) -> web.Response:
    """GET /is_sleeping: `{"is_sleeping": bool}` when every worker agrees."""
    results = await fan_out(state_of(request).engine, Utility.IS_SLEEPING)
    return json_response({"is_sleeping": bool(all_agree("is_sleeping", results))})


async def _sleep_level(request: web.Request) -> int:
    raw = await request.read()
    level = decode_body(raw, SleepBody).level if raw.strip() else None
    query = request.query.get("level")
    if query is not None:
        try:
            level = int(query)
        except ValueError:
            raise BadRequest(f"level must be 1 or 2, got {query!r}", "level") from None
    level = 1 if level is None else level
    if level not in SLEEP_LEVELS:
        raise BadRequest(f"level must be 1 or 2, got {level}", "level")
    return level


async def sleep(request: web.Request) -> web.Response:
    """POST /sleep?level=1|2 (or a JSON body `{"level": ...}`): level 1 frees the KV cache, 2 the weights."""
    level = await _sleep_level(request)
    require_all_succeeded("sleep", await fan_out(state_of(request).engine, Utility.SLEEP, level))
    return json_response({"success": True, "level": level})


async def wake_up(request: web.Request) -> web.Response:
    """POST /wake_up."""
    require_all_succeeded("wake_up", await fan_out(state_of(request).engine, Utility.WAKE_UP))
    return json_response({"success": True})


async def reset_prefix_cache(request: web.Request) -> web.Response:
    """POST /reset_prefix_cache (and SGLang's /flush_cache)."""
    all_true("reset_prefix_cache", await fan_out(state_of(request).engine, Utility.RESET_PREFIX_CACHE))
    return json_response({"success": True})


def add_routes(app: web.Application) -> None:
    """Register the utility routes on `app`."""
    app.router.add_get("/is_sleeping", is_sleeping)
    app.router.add_post("/sleep", sleep)
    app.router.add_post("/wake_up", wake_up)
    for path in ("/reset_prefix_cache", "/flush_cache"):
        app.router.add_post(path, reset_prefix_cache)
