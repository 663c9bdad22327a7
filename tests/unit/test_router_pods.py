"""Discovery's pure policy (disagg/router/pods.py) and the pool's add/drain/readmit."""

from __future__ import annotations

import pytest

from disagg.config import ConfigError
from disagg.registry_config import RetryConfig
from disagg.router.discovery import retry_wait_s
from disagg.router.config import DiscoveryConfig, PrefillEndpoint, RouterConfig
from disagg.router.policy import ServerLoad
from disagg.router.pods import (
    Action, ActionKind, Endpoint, EventType, PodTracker, PodView, pod_view, reconcile,
)
from disagg.router.workers import Health, Role, WorkerInfo, WorkerPool

ANNOTATION = "sglang.ai/bootstrap-port"


def pod(name: str, ip: str | None = "10.0.0.1", ready: bool = True, deleting: bool = False, ports=(),
        annotations=None, phase: str = "Running") -> dict:
    meta = {"name": name, "namespace": "ns", "resourceVersion": "7", "annotations": annotations or {}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status = {"phase": phase, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    containers = [{"name": "server", "ports": [{"name": n, "containerPort": p} for n, p in ports]}]
    return {"metadata": meta, "spec": {"containers": containers}, "status": status}


def view(raw: dict) -> PodView:
    return pod_view(raw, 8000, ANNOTATION)


def test_pod_view_reads_ports_readiness_and_termination():
    assert view(pod("p0", ports=[("http", 30001), ("bootstrap", 9000)])) == PodView(
        "ns/p0", "10.0.0.1", True, False, 30001, 9000)
    annotated = view(pod("p1", ports=[("bootstrap", 9000)], annotations={ANNOTATION: "8999"}))
    assert (annotated.http_port, annotated.bootstrap_port, annotated.url) == (8000, 8999, "http://10.0.0.1:8000")
    assert view(pod("p2", annotations={ANNOTATION: "not-a-port"})).bootstrap_port == 8998
    assert view(pod("p3", ip="fd00::5", ports=[("http", 80)])).url == "http://[fd00::5]:80"
    assert [view(p).serving for p in (pod("a"), pod("b", ready=False), pod("c", deleting=True), pod("d", ip=None),
                                      pod("e", phase="Pending"))] == [True, False, False, False, False]


def test_tracker_wants_serving_pods_and_forgets_deleted_ones():
    tracker = PodTracker(with_bootstrap_port=True)
    tracker.replace_all([view(pod("p0", ip="10.0.0.1")), view(pod("p1", ip="10.0.0.2", ready=False))])
    assert tracker.wanted() == {"http://10.0.0.1:8000": Endpoint("http://10.0.0.1:8000", 8998)}
    tracker.apply(EventType.MODIFIED, view(pod("p1", ip="10.0.0.2")))
    tracker.apply(EventType.DELETED, view(pod("p0", ip="10.0.0.1")))
    assert list(tracker.wanted()) == ["http://10.0.0.2:8000"]
    decode = PodTracker(with_bootstrap_port=False)
    decode.apply(EventType.ADDED, view(pod("d0", ip="10.0.1.1")))
    assert decode.wanted() == {"http://10.0.1.1:8000": Endpoint("http://10.0.1.1:8000", None)}


def member(index: int, url: str, admitting: bool) -> WorkerInfo:
    return WorkerInfo(Role.PREFILL, index, url, 8998, Health.HEALTHY, 0, 1, None, admitting)


def test_reconcile_adds_drains_and_readmits():
    a, b, c = "http://10.0.0.1:80", "http://10.0.0.2:80", "http://10.0.0.3:80"
    members = [member(0, a, True), member(1, b, True), member(2, c, False)]
    wanted = {a: Endpoint(a, 8998), c: Endpoint(c, 8998), "http://10.0.0.4:80": Endpoint("http://10.0.0.4:80", 8998)}
    assert reconcile(wanted, members) == [
        Action(ActionKind.DRAIN, b, 8998, 1),
        Action(ActionKind.READMIT, c, 8998, 2),
        Action(ActionKind.ADD, "http://10.0.0.4:80", 8998),
    ]
    # A new bootstrap port on the same URL is another server: drain the old, add the new.
    assert reconcile({a: Endpoint(a, 9000)}, members[:1]) == [Action(ActionKind.DRAIN, a, 8998, 0),
                                                             Action(ActionKind.ADD, a, 9000)]
    assert reconcile({a: Endpoint(a, 8998)}, members[:1]) == []


def test_pool_drains_a_server_once_its_requests_end_and_never_reuses_ids():
    pool = WorkerPool([], [])
    d0 = pool.add(Role.DECODE, "http://d:0", None)
    d1 = pool.add(Role.DECODE, "http://d:1", None)
    assert (d0, d1) == (0, 1)
    assert pool.loads(Role.DECODE) == [ServerLoad(False, 0, d0), ServerLoad(False, 0, d1)]  # PENDING until checked
    pool.set_health(Role.DECODE, d0, Health.HEALTHY)
    pool.set_health(Role.DECODE, d1, Health.HEALTHY)
    pool.begin(Role.DECODE, d0)
    assert pool.drain(Role.DECODE, d0) is False
    assert pool.loads(Role.DECODE) == [ServerLoad(False, 1, d0), ServerLoad(True, 0, d1)]
    assert (pool.num_healthy(Role.DECODE), pool.first_eligible(Role.DECODE)) == (1, d1)
    assert pool.info(Role.DECODE, d0).as_json()["draining"] is True
    pool.end(Role.DECODE, d0)
    assert pool.ids(Role.DECODE) == [d1] and not pool.contains(Role.DECODE, d0)
    assert pool.set_health(Role.DECODE, d0, Health.HEALTHY) is None  # a late check of a forgotten server
    assert pool.drain(Role.DECODE, d1) is True and pool.size(Role.DECODE) == 0
    assert pool.add(Role.DECODE, "http://d:0", None) == 2


def test_pool_readmits_a_draining_server_only_after_a_new_check():
    pool = WorkerPool([], [])
    p0 = pool.add(Role.PREFILL, "http://p:0", 8998)
    pool.set_health(Role.PREFILL, p0, Health.HEALTHY)
    pool.begin(Role.PREFILL, p0)
    pool.drain(Role.PREFILL, p0)
    pool.readmit(Role.PREFILL, p0)
    assert pool.loads(Role.PREFILL) == [ServerLoad(False, 1, p0)]
    pool.set_health(Role.PREFILL, p0, Health.HEALTHY)
    pool.end(Role.PREFILL, p0)
    assert pool.loads(Role.PREFILL) == [ServerLoad(True, 0, p0)]


def test_retries_back_off_while_failures_come_in_a_row():
    retry = RetryConfig(0.5, 3.0)
    assert [retry_wait_s(retry, n, expired=False) for n in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    # A 410 after a healthy watch lists again at once; a 410 that follows failures waits like them.
    assert [retry_wait_s(retry, n, expired=True) for n in range(3)] == [0.0, 1.0, 2.0]


def test_discovery_config_checks_its_values():
    config = DiscoveryConfig(prefill_selector=("app=disagg", "role=prefill"), decode_selector=("role=decode",))
    assert (config.prefill_label_selector, config.decode_label_selector) == ("app=disagg,role=prefill", "role=decode")
    assert RouterConfig(discovery=config).prefill == ()
    with pytest.raises(ConfigError, match="service discovery needs --decode-selector"):
        DiscoveryConfig(prefill_selector=("a=b",))
    with pytest.raises(ConfigError, match="--prefill-selector takes key=value items, got 'app'"):
        DiscoveryConfig(prefill_selector=("app",), decode_selector=("a=b",))
    with pytest.raises(ConfigError, match="give no --prefill or --decode"):
        RouterConfig(prefill=(PrefillEndpoint("http://p:1"),), discovery=config)
    with pytest.raises(ConfigError, match="--service-discovery-max-backoff-s must be at least"):
        DiscoveryConfig(prefill_selector=("a=b",), decode_selector=("a=b",), backoff_s=2, max_backoff_s=1)


def test_a_forgotten_server_loses_its_pick_series_unless_its_url_is_back_under_a_new_id():
    from disagg.router.metrics import RouterMetrics

    pool, metrics = WorkerPool([], []), RouterMetrics()
    metrics.watch_pool(pool)
    first, second = pool.add(Role.DECODE, "http://d:0", None), pool.add(Role.DECODE, "http://d:1", None)
    for url in ("http://d:0", "http://d:1"):
        metrics.picks.labels("decode", url).inc()

    def picked() -> dict[str, float]:
        return {s.labels["worker"]: s.value for m in metrics.registry.collect() if m.name == "disagg_router_picks"
                for s in m.samples if s.name.endswith("_total")}

    again = pool.add(Role.DECODE, "http://d:0", None)  # the same pod back (a new id) while the old one drains
    assert pool.drain(Role.DECODE, first) is True
    assert picked() == {"http://d:0": 1.0, "http://d:1": 1.0}  # its URL is still served: the series stays
    assert pool.drain(Role.DECODE, again) is True and pool.drain(Role.DECODE, second) is True
    assert picked() == {}
