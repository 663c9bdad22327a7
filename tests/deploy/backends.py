"""Stand-ins for prefill and decode servers (real HTTP on 127.0.0.1, port 0), and helpers to run
our router with Kubernetes discovery against the fake API (fake_kube.py)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import aiohttp
from aiohttp import web

from disagg.router.config import DiscoveryConfig, RouterConfig
from disagg.router.server import RouterServer
from disagg.router.workers import Role
from fake_kube import FakeKube

PREFILL_LABELS = {"app": "disagg", "role": "prefill"}
DECODE_LABELS = {"app": "disagg", "role": "decode"}
# On loopback, a pod event reaches the pool and a new server passes the router's own health check
# within this long (the docs promise "at once, plus one health check").
FOLLOW_BOUND_S = 1.5


class Backend:
    """Answers /health with `health_status` and every generate path with `{"server": name}` after
    `delay_s`; counts what it started and finished."""

    def __init__(self, name: str, delay_s: float = 0.0, health_status: int = 200):
        self.name = name
        self.delay_s = delay_s
        self.health_status = health_status
        self.started = 0
        self.finished = 0
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> Backend:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_post("/generate", self._generate)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = self._runner.addresses[0][1]
        return self

    async def close(self) -> None:
        await self._runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.health_status)

    async def _generate(self, request: web.Request) -> web.Response:
        await request.read()
        self.started += 1
        await asyncio.sleep(self.delay_s)
        self.finished += 1
        return web.json_response({"server": self.name})


def discovery_config(kubeconfig: str, **options) -> DiscoveryConfig:
    return DiscoveryConfig(prefill_selector=("app=disagg", "role=prefill"), decode_selector=("app=disagg", "role=decode"),
                           namespace="disagg", kubeconfig=kubeconfig, backoff_s=0.05, max_backoff_s=0.2, **options)


@contextlib.asynccontextmanager
async def discovering_router(kube: FakeKube, tmp_path: Path, **options):
    """Our router, in process, finding its servers through `kube` (health rounds every 60 s, so only
    discovery's own checks make a new server eligible)."""
    kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig")
    config = RouterConfig(port=0, health_check_interval_s=60, health_check_timeout_s=1.0,
                          discovery=discovery_config(kubeconfig), **options)
    async with RouterServer(config) as router:
        yield router


def members(router: RouterServer, role: Role) -> list[tuple[str, str, bool, int]]:
    """(url, health, admitting, in_flight) of every server of `role` the router knows."""
    return [(i.url, i.health.value, i.admitting, i.in_flight) for i in router.router.pool.infos(role)]


async def wait_until(predicate, timeout_s: float = FOLLOW_BOUND_S) -> None:
    """Poll until `predicate()` holds; fails past `timeout_s`."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not predicate():
        assert loop.time() - start < timeout_s, f"not within {timeout_s} s"
        await asyncio.sleep(0.01)


async def generate(session: aiohttp.ClientSession, router: RouterServer) -> tuple[int, dict]:
    async with session.post(router.url + "/generate", json={"text": "hi"}) as resp:
        return resp.status, await resp.json(content_type=None)
