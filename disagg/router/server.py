"""Running the router: on a port of the current event loop (tests, `disagg serve`), or standalone
until SIGINT/SIGTERM (`disagg router`), printing `ready: http://HOST:PORT` once it listens, and
draining before it exits.
"""

from __future__ import annotations

import asyncio
import random
import secrets
import sys
from collections.abc import Callable

import structlog
from aiohttp import web

from disagg.drain import CLOSE_TIMEOUT_S, Drain, StopSignals
from disagg.http_site import server_ssl_context, start_site
from disagg.logs import configure_logging
from disagg.router.app import Router, create_app
from disagg.router.config import RouterConfig

log = structlog.get_logger("disagg.router")


class RouterServer:
    """The router app bound to a port of the running loop.

        async with RouterServer(config) as server:   # binds config.host:config.port (0: any)
            ... server.url ...
    """

    def __init__(self, config: RouterConfig, rng: random.Random | None = None,
                 randbits: Callable[[int], int] = secrets.randbits):
        self.config = config
        self.router = Router(config, rng, randbits)
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        """http(s)://host:port once started."""
        if self.port is None:
            raise RuntimeError("router is not started")
        return f"{self.config.tls.scheme}://{self.config.host}:{self.port}"

    async def start(self) -> int:
        """Run the first health checks, bind and serve; returns the bound port."""
        if self._runner is not None:
            raise RuntimeError("router already started")
        ssl_context = server_ssl_context(self.config.tls)
        # A client that leaves cancels its handler, which cancels both legs (the servers then abort).
        self._runner, self.port = await start_site(create_app(self.router), self.config.host, self.config.port,
                                                   ssl_context, access_log=None, handler_cancellation=True,
                                                   shutdown_timeout=CLOSE_TIMEOUT_S)
        log.info("router started", url=self.url, policy=self.config.policy,
                 prefill=[p.url for p in self.config.prefill], decode=list(self.config.decode),
                 test_external_dp_routing=self.config.test_external_dp_routing)
        return self.port

    @property
    def drain(self) -> Drain:
        """`await drain.run(timeout_s)` before `close()` to let requests in flight finish."""
        return self.router.drain

    async def close(self) -> None:
        """Stop serving and close every upstream connection; idempotent."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def __aenter__(self) -> RouterServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()


async def serve_forever(config: RouterConfig) -> int:
    """Serve until SIGINT or SIGTERM, then drain (`shutdown_timeout_s`); the ready line goes to stdout."""
    signals = StopSignals()
    signals.install()
    async with RouterServer(config) as server:
        print(f"ready: {server.url}", flush=True)
        await signals.requested.wait()
        log.info("router draining", in_flight=server.drain.num_in_flight, shutdown_timeout_s=config.shutdown_timeout_s)
        aborted = await server.drain.run(config.shutdown_timeout_s, signals.hurry)
        log.info("router shutting down", aborted=aborted)
    return 0


def run(config: RouterConfig) -> int:
    """`disagg router`: configure logging, serve until interrupted; the exit code (1 if it cannot start)."""
    configure_logging(config.log_format)
    try:
        return asyncio.run(serve_forever(config))
    except OSError as exc:  # the port is taken, the host cannot be bound
        print(f"error: router cannot listen on {config.host}:{config.port}: {exc}", file=sys.stderr, flush=True)
        return 1
