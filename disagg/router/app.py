"""The router's aiohttp application: P/D-dispatched generate endpoints, health, listings, models.

Routes:
- `POST /generate`, `/v1/completions`, `/v1/chat/completions`, `/inference/v1/generate`: P/D dispatch
- `GET /v1/models`: from the first healthy decode server
- `GET /health`: 200 while at least one prefill and one decode server are healthy, else 503 (and
  503 `draining` once the router shuts down: new generate requests get the same)
- `GET /health_generate`: every eligible server's `/health_generate` must answer 2xx
- `GET /server_info`, `/get_server_info`, `/workers`: the servers, their health, load and dp_size
- `GET` and `DELETE /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`: a stored Response (or a background
  run), from the decode that stored it
- `GET /metrics`: the router's Prometheus metrics, and its servers' engine families added up
Every error is OpenAI-shaped JSON; unknown routes are 404. With `api_key`, every route but `/health`
and `/metrics` needs `Authorization: Bearer <key>` (401 otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import secrets
from collections.abc import Callable

import aiohttp
import msgspec
import structlog
from aiohttp import web

from disagg.config import admin_key
from disagg.drain import Drain
from disagg.http_edge import Edge, HttpError, error_middleware, http_error_of, invocation_path
from disagg.http_site import client_ssl_context
from disagg.router.cache_aware import CacheAwarePairPicker
from disagg.router.config import RouterConfig
from disagg.router.discovery import Discovery
from disagg.router.errors import NoHealthyServer, RouterDraining
from disagg.router.health import HealthChecker
from disagg.router.kv_index import KVIndex
from disagg.router.kv_subscriber import KVEventSubscriber
from disagg.router import conversations, federation, passthrough, traces
from disagg.router.conversations import RESPONSES_PATH
from disagg.router.legs import LegClient
from disagg.router.metrics import RouterMetrics
from disagg.router.compat import incompatible_prefills
from disagg.router.planning import RolePlanner
from disagg.router.policy import PairPicker, Policy
from disagg.router.proxy import Proxy
from disagg.router.workers import Health, Role, WorkerPool
from disagg.tracing import open_tracing
from disagg.wire.auth import bearer_matches

log = structlog.get_logger("disagg.router")
GENERATE_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions", "/inference/v1/generate", "/v1/responses")
OPEN_PATHS = frozenset({"/health", "/metrics"})
# Every failure leaves as JSON with the right status; one request never kills the router.
KV_EVENTS_WATCH_S = 0.5  # how soon a prefill's KV events are subscribed to once its dp_size is known
ROUTER_EDGE = Edge(error_of=functools.partial(http_error_of, log=log))


class Router:
    """The running router's parts; `start()` opens the one ClientSession, `close()` releases it."""

    def __init__(self, config: RouterConfig, rng: random.Random | None = None,
                 randbits: Callable[[int], int] = secrets.randbits):
        self.config = config
        initial = Health.UNKNOWN if config.health_checks_enabled else Health.HEALTHY
        self.pool = WorkerPool(config.prefill, config.decode, initial)
        self._rng = rng if rng is not None else random.Random()
        self._randbits = randbits
        self.kv_index = KVIndex() if config.cache_aware.prefill_kv_events else None
        self.picker = (CacheAwarePairPicker(config.cache_aware, self._rng, self.kv_index)
                       if config.policy is Policy.CACHE_AWARE else PairPicker(config.policy, self._rng))
        self.kv_events: KVEventSubscriber | None = None
        self._kv_watch: asyncio.Task | None = None
        self.drain = Drain("router")
        self.session: aiohttp.ClientSession | None = None
        self.health: HealthChecker | None = None
        self.proxy: Proxy | None = None
        self.legs: LegClient | None = None
        self.discovery: Discovery | None = None
        self.metrics = RouterMetrics()
        self.metrics.watch_pool(self.pool)
        self.planner: RolePlanner | None = None
        self.tracing = open_tracing(config.otlp_traces_endpoint, "disagg-router")  # None: tracing off

    async def start(self) -> None:
        """Open the session, run the first health checks, start the checker loop (and discovery)."""
        cfg = self.config
        upstream_tls = client_ssl_context(cfg.upstream_ca_certs, cfg.upstream_certfile, cfg.upstream_keyfile)
        connector = aiohttp.TCPConnector(limit=cfg.max_connections, limit_per_host=0, ssl=upstream_tls)
        timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s, connect=cfg.connect_timeout_s)
        self.session = aiohttp.ClientSession(connector=connector, timeout=timeout)
        self.health = HealthChecker(self.config, self.pool, self.session)
        self.legs = LegClient(self.session, self.config.request_timeout_s, self.config.connect_timeout_s)
        self.proxy = Proxy(self.config, self.pool, self.health, self.legs, self.picker, self._rng, self._randbits,
                           self.drain, self.metrics)
        await self.health.start()
        self.planner = RolePlanner(cfg.planning, self.pool, self.session, self.metrics.registry,
                                   cfg.health_check_timeout_s, admin_key(),
                                   whole_local=cfg.policy is Policy.CACHE_AWARE)
        self.planner.start()
        if self.kv_index is not None:
            self.kv_events = KVEventSubscriber(self.kv_index, on_batch=self.metrics.kv_event_batches.inc)
            self._kv_watch = asyncio.create_task(self._watch_kv_events())
        if cfg.discovery is not None:
            self.discovery = Discovery(cfg.discovery, self.pool, self.health)
            await self.discovery.start()

    async def _watch_kv_events(self) -> None:
        """Subscribe to each prefill's KV events once its dp_size is known (and drop servers that left)."""
        endpoints = dict(zip((p.url for p in self.config.prefill), self.config.cache_aware.prefill_kv_events))
        while True:
            ids = self.pool.ids(Role.PREFILL)
            for server_id in ids:
                url = self.pool.info(Role.PREFILL, server_id).url
                if url in endpoints and not self.kv_events.watched(server_id):
                    with contextlib.suppress(Exception):  # not reachable yet: the next round asks again
                        dp_size = await self.health.ensure_dp_size(Role.PREFILL, server_id)
                        self.kv_events.watch(server_id, endpoints[url], dp_size)
            for server_id in self.kv_events.servers() - set(ids):
                self.kv_events.unwatch(server_id)
            await asyncio.sleep(KV_EVENTS_WATCH_S)

    async def close(self) -> None:
        """Stop discovery and health checks and close every connection; idempotent."""
        kv_watch, self._kv_watch = self._kv_watch, None
        if kv_watch is not None:
            kv_watch.cancel()
            await asyncio.gather(kv_watch, return_exceptions=True)
        kv_events, self.kv_events = self.kv_events, None
        if kv_events is not None:
            await kv_events.close()
        discovery, self.discovery = self.discovery, None
        if discovery is not None:
            await discovery.close()
        if self.planner is not None:
            await self.planner.close()
        if self.health is not None:
            await self.health.close()
        session, self.session = self.session, None
        if session is not None:
            await session.close()
        tracing, self.tracing = self.tracing, None
        if tracing is not None:  # the spans not sent yet go out
            await asyncio.to_thread(tracing.close)


ROUTER_KEY = web.AppKey("router", Router)


def _router(request: web.Request) -> Router:
    return request.app[ROUTER_KEY]


def _json(payload: object, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(payload), status=status, content_type="application/json")


async def generate(request: web.Request, path: str | None = None, raw: bytes | None = None) -> web.StreamResponse:
    """P/D dispatch; the same path (`path`, else the request's) is called on both servers, with `raw`
    (else the request's body). Refused (503) while the router drains."""
    router = _router(request)
    if router.drain.draining:
        raise RouterDraining(router.drain.refusal_message())
    with router.drain.track():
        if router.tracing is None:
            return await router.proxy.serve(request, path or request.path, raw)
        return await traces.traced(router.tracing, request, path or request.path, router.proxy.serve, raw)


async def responses(request: web.Request) -> web.StreamResponse:
    """POST /v1/responses: P/D dispatch; a `previous_response_id` is resolved first to the conversation
    the decode that answered it stored (disagg/router/conversations.py), which both legs then get."""
    router = _router(request)
    raw = await conversations.with_conversation(router.session, await request.read(),
                                                [info.url for info in router.pool.infos(Role.DECODE)],
                                                router.config.health_check_timeout_s, passthrough.authorization(request))
    return await generate(request, raw=raw)


async def stored_response(request: web.Request) -> web.StreamResponse:
    """GET or DELETE /v1/responses/{id}, POST its /cancel: the decode that stored the answer answers it (a
    streamed background run's events, `?stream=true`, relayed as they come)."""
    router = _router(request)
    decodes = [info.url for info in router.pool.infos(Role.DECODE)]
    return await conversations.from_holder(request, router.session, decodes, router.config.health_check_timeout_s,
                                           passthrough.authorization(request))


async def invocations(request: web.Request) -> web.StreamResponse:
    """POST /invocations (SageMaker's): dispatched as the chat or completions request its body is."""
    return await generate(request, invocation_path(await request.read()))


async def load(request: web.Request) -> web.Response:
    """GET /load (vLLM's): the generate requests the router is serving now."""
    return web.json_response({"server_load": _router(request).drain.num_in_flight})


async def metrics(request: web.Request) -> web.Response:
    """The router's own families, then (--federate-metrics) its servers' engine families added up."""
    router = _router(request)
    urls = [info.url for role in Role for info in router.pool.infos(role)] if router.config.federate_metrics else []
    summed, num_failed = await federation.federate(router.session, urls, router.config.health_check_timeout_s)
    router.metrics.federation_failures.inc(num_failed)
    return router.metrics.render(summed)


async def health(request: web.Request) -> web.Response:
    """200 while a pair can be formed from servers whose last check succeeded; 503 while draining."""
    router = _router(request)
    if router.drain.draining:
        raise RouterDraining(router.drain.refusal_message())
    pool = router.pool
    counts = {role: pool.num_healthy(role) for role in Role}
    for role, count in counts.items():
        if count == 0:
            raise NoHealthyServer(str(role))
    return _json({"status": "ok", "healthy_prefill": counts[Role.PREFILL], "healthy_decode": counts[Role.DECODE]})


async def health_generate(request: web.Request) -> web.Response:
    """Every eligible server's `/health_generate`, concurrently; 503 naming those that failed."""
    router = _router(request)
    targets = [info for role in Role for info in router.pool.infos(role) if info.health is not Health.UNHEALTHY]
    headers = passthrough.authorization(request)
    outcomes = await asyncio.gather(*(passthrough.send(router, info.role, info.url, "GET", "/health_generate", headers)
                                      for info in targets),
                                    return_exceptions=True)
    failed = []
    for info, outcome in zip(targets, outcomes):
        if isinstance(outcome, BaseException):
            failed.append(f"{info.role} {info.url}: {outcome}")
        elif not 200 <= outcome[0] < 300:
            failed.append(f"{info.role} {info.url}: answered {outcome[0]}")
    if failed or not targets:
        raise HttpError(503, "health_generate failed: " + ("; ".join(failed) or "no eligible server"))
    return _json({"status": "ok", "checked": [info.url for info in targets]})


async def server_info(request: web.Request) -> web.Response:
    """The router's settings and every server with its health, requests in flight and dp_size."""
    return _json(router_view(_router(request)))


def router_view(router: Router) -> dict:
    cfg = router.config
    return {
        "router": {"policy": cfg.policy, "test_external_dp_routing": cfg.test_external_dp_routing,
                   "trust_client_routing": cfg.trust_client_routing,
                   "request_timeout_s": cfg.request_timeout_s, "health_check_interval_s": cfg.health_check_interval_s},
        "prefill": [info.as_json() for info in router.pool.infos(Role.PREFILL)],
        "decode": [_with_incompatible(router.pool, info) for info in router.pool.infos(Role.DECODE)],
    }


def _with_incompatible(pool: WorkerPool, info) -> dict:
    """A decode's entry, with the prefill servers it cannot pair with and why (disagg/router/compat.py)."""
    out = info.as_json()
    incompatible = incompatible_prefills(pool, info.compatibility)
    if incompatible:
        out["incompatible_prefills"] = incompatible
    return out


def api_key_middleware(api_key: str):
    """401 unless the request carries `Authorization: Bearer <api_key>` (the probes stay open)."""

    @web.middleware
    async def check_api_key(request: web.Request, handler) -> web.StreamResponse:
        if request.path not in OPEN_PATHS and not bearer_matches(request.headers.get("Authorization"), api_key):
            raise HttpError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'",
                            code="invalid_api_key")
        return await handler(request)

    return check_api_key


def create_app(router: Router) -> web.Application:
    """The application; `router` is started on app startup and closed on cleanup."""
    middlewares = [error_middleware(ROUTER_EDGE), router.metrics.http.middleware()]
    if router.config.api_key is not None:
        middlewares.append(api_key_middleware(router.config.api_key))
    app = web.Application(middlewares=middlewares, client_max_size=router.config.max_body_bytes)
    app[ROUTER_KEY] = router

    async def lifecycle(_app: web.Application):
        await router.start()
        yield
        await router.close()

    app.cleanup_ctx.append(lifecycle)
    for path in GENERATE_PATHS:
        app.router.add_post(path, responses if path == RESPONSES_PATH else generate)
    app.router.add_post("/invocations", invocations)
    app.router.add_get(RESPONSES_PATH + "/{response_id}", stored_response)
    app.router.add_delete(RESPONSES_PATH + "/{response_id}", stored_response)
    app.router.add_post(RESPONSES_PATH + "/{response_id}/cancel", stored_response)
    app.router.add_get("/load", load)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health_generate", health_generate)
    for path in ("/server_info", "/workers"):
        app.router.add_get(path, server_info)
    passthrough.register(app, _router, router_view)
    return app
