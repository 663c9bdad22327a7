"""Our router's Kubernetes discovery against a local fake API server (list + watch over real HTTP,
kubernetes_asyncio as the client): pods join only when Ready and checked by the router itself,
drain when unready or terminating (their requests in flight finish), come back under a new
address, and a 410 Gone or a failing API server is survived by listing again."""

import asyncio
import sys

import aiohttp
import pytest

from backends import DECODE_LABELS, PREFILL_LABELS, discovering_router, generate, members, wait_until
from disagg.config import ConfigError
from disagg.router.discovery import MISSING_CLIENT, load_client
from disagg.router.workers import Role
from fake_kube import ready_pod

pytestmark = pytest.mark.timeout(30)
NO_DECODE = {"error": {"message": "no healthy decode server", "type": "ServiceUnavailableError", "param": None,
                       "code": "no_healthy_server"}}


async def test_a_ready_pod_gets_requests_only_after_the_routers_own_health_check(kube, backends, tmp_path):
    p0, d0, d1 = await backends("p0"), await backends("d0", health_status=503), await backends("d1")
    kube.put(ready_pod("p0", p0.port, PREFILL_LABELS, bootstrap_port=9000))
    kube.put(ready_pod("d0", d0.port, DECODE_LABELS))  # Ready to Kubernetes, but its /health says 503
    kube.put(ready_pod("d1", d1.port, DECODE_LABELS, ready=False))
    async with discovering_router(kube, tmp_path) as router, aiohttp.ClientSession() as http:
        await wait_until(lambda: members(router, Role.DECODE) == [(d0.url, "unhealthy", True, 0)])
        assert members(router, Role.PREFILL) == [(p0.url, "healthy", True, 0)]
        assert router.router.pool.info(Role.PREFILL, 0).bootstrap_port == 9000
        assert await generate(http, router) == (503, NO_DECODE)
        kube.put(ready_pod("d1", d1.port, DECODE_LABELS))
        await wait_until(lambda: (d1.url, "healthy", True, 0) in members(router, Role.DECODE))
        assert [await generate(http, router) for _ in range(3)] == [(200, {"server": "d1"})] * 3
        assert (d0.started, d1.started, p0.started) == (0, 3, 3)


async def test_a_terminating_pod_is_drained_and_its_request_in_flight_finishes(kube, backends, tmp_path):
    p0, d0, d1 = await backends("p0"), await backends("d0", delay_s=0.8), await backends("d1")
    kube.put(ready_pod("p0", p0.port, PREFILL_LABELS))
    kube.put(ready_pod("d0", d0.port, DECODE_LABELS))
    async with discovering_router(kube, tmp_path) as router, aiohttp.ClientSession() as http:
        await wait_until(lambda: members(router, Role.DECODE) == [(d0.url, "healthy", True, 0)])
        in_flight = asyncio.create_task(generate(http, router))
        await wait_until(lambda: d0.started == 1)
        kube.put(ready_pod("d1", d1.port, DECODE_LABELS))
        kube.put(ready_pod("d0", d0.port, DECODE_LABELS, deleting=True))
        await wait_until(lambda: members(router, Role.DECODE) == [  # within FOLLOW_BOUND_S
            (d0.url, "healthy", False, 1), (d1.url, "healthy", True, 0)])
        assert await generate(http, router) == (200, {"server": "d1"})
        assert await in_flight == (200, {"server": "d0"})
        assert members(router, Role.DECODE) == [(d1.url, "healthy", True, 0)]  # forgotten once idle
        assert (d0.started, d0.finished, d1.started) == (1, 1, 1)


async def test_an_unready_pod_leaves_and_comes_back_under_a_new_address(kube, backends, tmp_path):
    p0, d0, d0_moved = await backends("p0"), await backends("d0"), await backends("d0-moved")
    kube.put(ready_pod("p0", p0.port, PREFILL_LABELS))
    kube.put(ready_pod("d0", d0.port, DECODE_LABELS))
    async with discovering_router(kube, tmp_path) as router, aiohttp.ClientSession() as http:
        await wait_until(lambda: members(router, Role.DECODE) == [(d0.url, "healthy", True, 0)])
        kube.put(ready_pod("d0", d0.port, DECODE_LABELS, ready=False))
        await wait_until(lambda: members(router, Role.DECODE) == [])
        assert await generate(http, router) == (503, NO_DECODE)
        kube.put(ready_pod("d0", d0.port, DECODE_LABELS))  # ready again at the same address
        await wait_until(lambda: members(router, Role.DECODE) == [(d0.url, "healthy", True, 0)])
        kube.delete("d0")
        kube.put(ready_pod("d0", d0_moved.port, DECODE_LABELS))  # recreated: a new address
        await wait_until(lambda: members(router, Role.DECODE) == [(d0_moved.url, "healthy", True, 0)])
        assert await generate(http, router) == (200, {"server": "d0-moved"})
        assert (d0.started, d0_moved.started) == (0, 1)


async def test_410_gone_and_a_failing_api_server_end_in_a_fresh_list(kube, backends, tmp_path):
    p0, d0, d1 = await backends("p0"), await backends("d0"), await backends("d1")
    kube.put(ready_pod("p0", p0.port, PREFILL_LABELS))
    kube.put(ready_pod("d0", d0.port, DECODE_LABELS))
    async with discovering_router(kube, tmp_path) as router:
        await wait_until(lambda: members(router, Role.DECODE) == [(d0.url, "healthy", True, 0)])
        await wait_until(lambda: len(kube.requests) == 4)  # a list and a watch per role
        assert sorted(kube.requests) == ["list", "list", "watch 102", "watch 102"]
        kube.fail_lists(2)
        kube.expire_watches()
        kube.delete("d0")
        kube.put(ready_pod("d1", d1.port, DECODE_LABELS))
        # Both watches end with 410; the lists fail twice (backoff 0.05 s, 0.1 s), then one per role works.
        await wait_until(lambda: members(router, Role.DECODE) == [(d1.url, "healthy", True, 0)], timeout_s=3)
        await wait_until(lambda: kube.requests[4:].count("watch 104") == 2)
        assert sorted(kube.requests[4:]) == ["list"] * 4 + ["watch 104"] * 2
        assert members(router, Role.PREFILL) == [(p0.url, "healthy", True, 0)]


def test_without_the_k8s_extra_discovery_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "kubernetes_asyncio", None)
    with pytest.raises(ConfigError) as caught:
        load_client()
    assert str(caught.value) == MISSING_CLIENT
    assert "pip install 'disagg[k8s]'" in MISSING_CLIENT
