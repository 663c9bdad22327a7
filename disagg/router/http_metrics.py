"""The router's HTTP and per-server metrics under sgl-model-gateway's names: every request counted
and timed by method and route (`smg_http_requests_total`, `smg_http_request_duration_seconds`),
every answer by route, status and error code (`smg_http_responses_total`), and at each scrape each
server's health and requests in flight (`smg_worker_health`, `smg_worker_requests_active`,
labelled `worker` = its URL). Routes are labelled by their pattern; unknown paths as `other`.
"""

from __future__ import annotations

import time

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from disagg.http_edge import HttpError
from disagg.router.workers import Health, Role

DURATION_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


def route_of(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "other"


class HttpMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter("smg_http_requests", "HTTP requests received by the router", ["method", "path"],
                                registry=registry)
        self.duration = Histogram("smg_http_request_duration_seconds", "HTTP request duration from receipt to the "
                                  "end of the answer", ["method", "path"], buckets=DURATION_BUCKETS_S, registry=registry)
        self.responses = Counter("smg_http_responses", "HTTP answers by route, status and error code",
                                 ["path", "status_code", "error_code"], registry=registry)

    def middleware(self):
        """Counts and times each request; sits inside the error middleware, so it sees HttpErrors' codes."""

        @web.middleware
        async def observe(request: web.Request, handler) -> web.StreamResponse:
            path, start = route_of(request), time.perf_counter()
            self.requests.labels(request.method, path).inc()
            status, code = 500, "internal_error"
            try:
                response = await handler(request)
                status, code = response.status, ""
                return response
            except HttpError as exc:
                status, code = exc.status, exc.code or ""
                raise
            except web.HTTPException as exc:
                status, code = exc.status, ""
                raise
            finally:
                self.duration.labels(request.method, path).observe(time.perf_counter() - start)
                self.responses.labels(path, str(status), code).inc()

        return observe


class WorkerCollector:
    """Each server's health (1 healthy, 0 unhealthy, -1 not checked yet) and requests in flight, and
    each prefill's legs not answered yet."""

    VALUES = {Health.HEALTHY: 1.0, Health.UNHEALTHY: 0.0, Health.UNKNOWN: -1.0, Health.PENDING: -1.0}

    def __init__(self, pool):
        self.pool = pool

    def collect(self):
        health = GaugeMetricFamily("smg_worker_health", "server health: 1 healthy, 0 unhealthy, -1 unchecked",
                                   labels=["worker", "worker_type"])
        active = GaugeMetricFamily("smg_worker_requests_active", "requests in flight on a server through this router",
                                   labels=["worker", "worker_type"])
        prefilling = GaugeMetricFamily("disagg_router_prefill_legs_active", "prefill legs sent to a prefill server that "
                                       "have not answered (--local-prefill-min-prefill-load reads them)", labels=["worker"])
        for role in Role:
            for info in self.pool.infos(role):
                health.add_metric([info.url, str(role)], self.VALUES[info.health])
                active.add_metric([info.url, str(role)], float(info.in_flight))
                if role is Role.PREFILL:
                    prefilling.add_metric([info.url], float(info.prefilling))
        yield health
        yield active
        yield prefilling
