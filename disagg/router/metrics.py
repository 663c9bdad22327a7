"""The router's Prometheus metrics, under sgl-model-gateway's names where it has one.

Each router owns its registry (two routers in one process, as in tests, never share counters).
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from disagg.prefix_tree import CacheOutcome
from disagg.router.http_metrics import HttpMetrics, WorkerCollector
from disagg.router.policy import PairPick

KV_WAIT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
MATCH_RATIO_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


class RouterMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.retries = Counter("sgl_router_retries", "requests sent again to a fresh pair after a leg failed before "
                               "any byte reached the client", ["route"], registry=self.registry)
        self.retries_exhausted = Counter("sgl_router_retries_exhausted", "requests whose last retry failed too",
                                         ["route"], registry=self.registry)
        self.cache_hits = Counter("sgl_router_cache_hits", "cache_aware prefill picks whose tree matched more than "
                                  "--cache-threshold of the prompt", registry=self.registry)
        self.cache_misses = Counter("sgl_router_cache_misses", "cache_aware prefill picks that went to the smallest "
                                    "tree (the match was at most --cache-threshold)", registry=self.registry)
        self.cache_imbalanced = Counter("disagg_router_cache_imbalanced_picks", "cache_aware prefill picks that went "
                                        "to the shortest queue (the prefills were imbalanced)", registry=self.registry)
        self.cache_match_ratio = Histogram("disagg_router_cache_match_ratio", "cache_aware: the share of the prompt the "
                                           "best prefill tree matched (hits and misses)", buckets=MATCH_RATIO_BUCKETS,
                                           registry=self.registry)

        self.kv_event_batches = Counter("disagg_router_kv_event_batches", "KV event batches received from the prefill "
                                        "workers (--prefill-kv-events)", registry=self.registry)
        self.picks = Counter("disagg_router_picks", "servers chosen for a request (the decode alone on a local "
                             "prefill)", ["role", "worker"], registry=self.registry)
        self.http = HttpMetrics(self.registry)
        self.prefills = Counter("disagg_router_prefills", "requests sent with a prefill (remote) or to the decode "
                                "alone (local: --max-local-prefill-tokens)", ["where"], registry=self.registry)
        self.answers = Counter("disagg_router_answers", "answers by their path (pd, decode-local, retried) and, "
                               "where not pd, why (X-Disagg-Path, X-Disagg-Path-Reason)", ["path", "reason"],
                               registry=self.registry)
        self.federation_failures = Counter("disagg_router_federation_failures", "servers whose /metrics did not "
                                           "answer in time at a scrape (left out of the summed engine families)",
                                           registry=self.registry)
        self.kv_wait = Histogram("disagg_router_kv_wait_seconds", "answers whose KV moved: the decode's wait for it "
                                 "(X-Disagg-KV-Wait-Ms), by path", ["path"], buckets=KV_WAIT_BUCKETS_S,
                                 registry=self.registry)
        self.local_prefills_refused = Counter("disagg_router_local_prefills_refused", "requests a decode would not "
                                              "prefill itself, sent again with a prefill", registry=self.registry)

    def record_answer(self, path: str, reason: str | None, kv_wait_ms: str | None) -> None:
        """One answer by its path and why; the decode's wait for its KV when the answer says it."""
        self.answers.labels(path, reason or "").inc()
        if kv_wait_ms is not None:
            self.kv_wait.labels(path).observe(float(kv_wait_ms) / 1e3)

    def record_pick(self, pick: PairPick) -> None:
        """Count where the prompt is prefilled, and how a cache_aware prefill was chosen."""
        self.prefills.labels("local" if pick.local else "remote").inc()
        if pick.cache_outcome is CacheOutcome.IMBALANCED:
            self.cache_imbalanced.inc()
        elif pick.cache_outcome is not None:
            (self.cache_hits if pick.cache_outcome is CacheOutcome.HIT else self.cache_misses).inc()
            self.cache_match_ratio.observe(pick.match_ratio)

    def watch_pool(self, pool) -> None:
        """Report each server's health and requests in flight at every scrape; a server the pool
        forgets (drained and idle) loses its `disagg_router_picks` series."""
        self.registry.register(WorkerCollector(pool))
        pool.on_forget = self.forget_server

    def forget_server(self, role, url: str) -> None:
        """Drop the pick counts of a server no longer known (nothing to drop: nothing happens)."""
        try:
            self.picks.remove(str(role), url)
        except KeyError:
            pass

    def render(self, federated: str = "") -> web.Response:
        """GET /metrics: the Prometheus text format, then `federated` (the servers' families added up)."""
        return web.Response(body=generate_latest(self.registry) + federated.encode(), content_type="text/plain",
                            charset="utf-8")
