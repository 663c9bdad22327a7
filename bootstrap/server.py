"""Bootstrap registry over HTTP (aiohttp), wire-compatible with SGLang's bootstrap server.

Routes (docs/protocol.md has examples):
- `PUT /route`               a prefill rank registers (any SGLang dialect, plus our fields)
- `GET /route?...`           all ranks -1: the topology; else one rank's address
- `POST /register_dp_rank`   `{bootstrap_room, dp_rank}`
- `POST /query_dp_ranks`     `{bootstrap_rooms: [...]}` -> `{"<room>": dp_rank}` for known rooms
- `GET /challenge`           a fresh nonce one write may answer (the cluster secret's proof)
- `GET /health`              `OK`

Errors are JSON `{"error": message}`: 400 malformed input, 401 missing or wrong cluster secret,
404 unknown rank (or path), 405 wrong method, 409 conflicting registration, 413 body too large,
429 room table full (`--max-rooms`), 503 topology incomplete. Malformed input never yields a 500.

With a cluster secret, the write routes (`PUT /route`, `POST /register_dp_rank`) need a proof in
X-Disagg-Cluster-Auth answering a nonce from `GET /challenge` (once, bound to this registry's address,
the writer, the method, the path and the body: disagg/wire/auth.py); the read routes stay open (real
SGLang decodes and routers read them).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable

import msgspec
import structlog
from aiohttp import web

from bootstrap.registry import (
    BootstrapRegistry,
    Registration,
    ConflictingRegistration,
    IncompleteTopology,
    InvalidRegistration,
    RegistryError,
    RegistryFull,
    UnknownRank,
)
from disagg.registry_config import BootstrapConfig
from disagg.http_edge import BadRequest, Edge, HttpError, decode_json, error_middleware
from disagg.http_site import start_site
from disagg.wire.auth import (
    NONCE_BYTES, REGISTRY, NonceTable, ProofRefused, check_proof, format_address, request_digest,
)
from disagg.wire.bootstrap_msgs import (
    ChallengeMsg,
    ErrorMsg,
    QueryDpRanksMsg,
    RegisterDpRankMsg,
    RouteBodyMsg,
    RouteDialect,
    dp_ranks_body,
    full_topology,
    parse_route_query,
    rank_address,
    sglang_topology,
)
from disagg.wire.headers import CLUSTER_AUTH_HEADER

Clock = Callable[[], float]
REGISTRY_KEY = web.AppKey("registry", BootstrapRegistry)
CLOCK_KEY = web.AppKey("clock", Callable[[], float])
CHALLENGES_KEY = web.AppKey("challenges", NonceTable)
WRITE_ROUTES = frozenset({("PUT", "/route"), ("POST", "/register_dp_rank")})
_STATUS_OF = {InvalidRegistration: 400, UnknownRank: 404, ConflictingRegistration: 409, RegistryFull: 429,
              IncompleteTopology: 503}
log = structlog.get_logger("bootstrap")


def _error_body(err: HttpError) -> bytes:
    return msgspec.json.encode(ErrorMsg(err.message))


def _registry_error(exc: Exception) -> HttpError | None:
    """BadRequest as it is, a RegistryError with its status; anything else is aiohttp's own 500."""
    if isinstance(exc, HttpError):
        return exc
    if isinstance(exc, RegistryError):
        return HttpError(_STATUS_OF.get(type(exc), 400), str(exc))
    return None


# Errors are `{"error": message}`; aiohttp's own (unknown path, wrong method, body too large) keep its texts.
REGISTRY_EDGE = Edge(error_of=_registry_error, render=_error_body, aiohttp_texts=True)


def _json(body: object, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(body), status=status, content_type="application/json")


def _targets(request: web.Request, host: str) -> tuple[str, ...]:
    """The addresses a proof may name: the local address the connection reached (which covers a
    wildcard bind), then the host this registry was configured to bind, on that port."""
    local_ip, port = request.transport.get_extra_info("sockname")[:2]
    return tuple(dict.fromkeys((format_address(local_ip, port), format_address(host, port))))


def cluster_secret_middleware(secret: str, host: str):
    """401 on the write routes unless they carry a proof answering one of our challenges."""

    @web.middleware
    async def check_cluster_secret(request: web.Request, handler):
        if (request.method, request.path) not in WRITE_ROUTES:
            return await handler(request)
        try:
            binding = check_proof(secret, REGISTRY, request.headers.get(CLUSTER_AUTH_HEADER),
                                  targets=_targets(request, host), nonces=request.app[CHALLENGES_KEY],
                                  now=request.app[CLOCK_KEY](),
                                  request=request_digest(request.method, request.path, await request.read()))
        except ProofRefused as exc:
            log.warning("registry write refused", method=request.method, path=request.path, remote=request.remote,
                        reason=exc.reason)
            err = HttpError(401, f"{request.method} {request.path} needs a cluster secret proof in "
                                 f"{CLUSTER_AUTH_HEADER} (see GET /challenge): {exc.reason}")
            return REGISTRY_EDGE.response(err, {"WWW-Authenticate": f'{CLUSTER_AUTH_HEADER} challenge="/challenge"'})
        log.debug("registry write authenticated", method=request.method, path=request.path, writer=binding.client)
        return await handler(request)

    return check_cluster_secret


async def _decode(request: web.Request, kind: type):
    return decode_json(await request.read(), kind, malformed="invalid JSON body",
                       invalid=f"invalid {request.method} {request.path} body", strict=False)


async def put_route(request: web.Request) -> web.Response:
    """A prefill rank registers itself."""
    body = await _decode(request, RouteBodyMsg)
    try:
        reg = body.to_registration()
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    registry = request.app[REGISTRY_KEY]
    outcome = registry.register_rank(reg)
    # Every rank registers again every few seconds (a restarted registry relearns the topology): a
    # repeat that changes nothing is a debug line, a new or moved rank an info line.
    (log.debug if outcome is Registration.REPEATED else log.info)(
        "prefill rank registered", outcome=outcome.value, dp_rank=reg.dp_rank, tp_rank=reg.tp_rank,
        pp_rank=reg.pp_rank, address=f"{reg.rank_ip}:{reg.rank_port}",
        registered=registry.num_registered, expected=registry.num_expected,
    )
    return _json({
        "status": "ok", "registration": outcome.value,
        "num_registered": registry.num_registered, "num_expected": registry.num_expected,
    })


async def get_route(request: web.Request) -> web.Response:
    """The topology (every rank -1) or one rank's address."""
    try:
        query = parse_route_query(request.query)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    registry = request.app[REGISTRY_KEY]
    if query.is_topology:
        topology = registry.topology()
        if query.dialect is RouteDialect.SGLANG:
            return _json(sglang_topology(topology))
        return _json(full_topology(topology))
    reg = registry.rank(query.dp_rank, query.tp_rank, query.pp_rank, query.cp_rank)
    return _json(rank_address(reg))


async def register_dp_rank(request: web.Request) -> web.Response:
    """A prefill worker records which DP rank serves a room."""
    body = await _decode(request, RegisterDpRankMsg)
    request.app[REGISTRY_KEY].register_room(body.bootstrap_room, body.dp_rank, request.app[CLOCK_KEY]())
    return _json({"status": "ok"})


async def query_dp_ranks(request: web.Request) -> web.Response:
    """Known rooms only; an empty object when none is known."""
    body = await _decode(request, QueryDpRanksMsg)
    found = request.app[REGISTRY_KEY].query_rooms(body.bootstrap_rooms, request.app[CLOCK_KEY]())
    return _json(dp_ranks_body(found))


async def challenge(request: web.Request) -> web.Response:
    """A fresh nonce one write may answer, once, within challenge_ttl_s (open: it reveals nothing)."""
    challenges = request.app[CHALLENGES_KEY]
    nonce = challenges.issue(os.urandom(NONCE_BYTES), request.app[CLOCK_KEY]())
    return _json(ChallengeMsg(nonce=nonce.hex(), expires_in_s=challenges.ttl_s))


async def health(request: web.Request) -> web.Response:
    """Liveness: 200 OK while the server runs (complete or not)."""
    return web.Response(text="OK")


def create_app(
    config: BootstrapConfig = BootstrapConfig(), clock: Clock = time.monotonic,
    registry: BootstrapRegistry | None = None,
) -> web.Application:
    """The aiohttp application; `clock` timestamps room entries (tests pass a fake one)."""
    middlewares = [error_middleware(REGISTRY_EDGE)]
    if config.cluster_secret is not None:
        middlewares.append(cluster_secret_middleware(config.cluster_secret, config.host))
    app = web.Application(middlewares=middlewares, client_max_size=config.max_body_bytes)
    app[REGISTRY_KEY] = registry if registry is not None else BootstrapRegistry(
        config.room_ttl_s, config.max_rooms, config.max_ranks)
    app[CLOCK_KEY] = clock
    app[CHALLENGES_KEY] = NonceTable(config.challenge_ttl_s)
    app.router.add_put("/route", put_route)
    app.router.add_get("/route", get_route)
    app.router.add_post("/register_dp_rank", register_dp_rank)
    app.router.add_post("/query_dp_ranks", query_dp_ranks)
    app.router.add_get("/challenge", challenge)
    app.router.add_get("/health", health)
    return app


class BootstrapServer:
    """The bootstrap app on a port of the current event loop, for hosting inside another process.

        async with BootstrapServer(config) as server:   # binds config.host:config.port
            ... server.port ...
    """

    def __init__(self, config: BootstrapConfig = BootstrapConfig(), clock: Clock = time.monotonic):
        self.config = config
        self.app = create_app(config, clock)
        self._runner: web.AppRunner | None = None
        self.host: str | None = None
        self.port: int | None = None

    @property
    def registry(self) -> BootstrapRegistry:
        """The live registry (read it; registration goes through HTTP)."""
        return self.app[REGISTRY_KEY]

    @property
    def url(self) -> str:
        """http://host:port once started."""
        if self.port is None:
            raise RuntimeError("bootstrap server is not started")
        return f"http://{self.host}:{self.port}"

    async def start(self, host: str | None = None, port: int | None = None) -> int:
        """Bind and serve; port 0 picks a free port. Returns the actual port."""
        if self._runner is not None:
            raise RuntimeError("bootstrap server already started")
        self.host = host if host is not None else self.config.host
        self._runner, self.port = await start_site(self.app, self.host, self.config.port if port is None else port,
                                                   access_log=None)
        log.info("bootstrap server started", url=self.url, room_ttl_s=self.config.room_ttl_s,
                 max_rooms=self.config.max_rooms, cluster_secret=self.config.cluster_secret is not None)
        return self.port

    async def close(self) -> None:
        """Stop serving; idempotent."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def __aenter__(self) -> BootstrapServer:
        if self._runner is None:
            await self.start()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()


def run_bootstrap(config: BootstrapConfig) -> int:
    """Standalone `disagg bootstrap`: print a ready line with the bound port, serve until Ctrl-C."""
    return asyncio.run(_serve_standalone(config))


async def _serve_standalone(config: BootstrapConfig) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with BootstrapServer(config) as server:
        print(f"ready: {server.url} (bootstrap registry)", flush=True)
        await stop.wait()
    return 0
