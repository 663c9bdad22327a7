"""The router's Prometheus metrics, under sgl-model-gateway's names where it has one.

Each router owns its registry (two routers in one process, as in tests, never share counters).
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, generate_latest


class RouterMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.retries = Counter("sgl_router_retries", "requests sent again to a fresh pair after a leg failed before "
                               "any byte reached the client", ["route"], registry=self.registry)
        self.retries_exhausted = Counter("sgl_router_retries_exhausted", "requests whose last retry failed too",
                                         ["route"], registry=self.registry)

    def render(self) -> web.Response:
        """GET /metrics: the Prometheus text format."""
        return web.Response(body=generate_latest(self.registry), content_type="text/plain", charset="utf-8")
