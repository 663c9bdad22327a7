"""Fixtures the end-to-end modules share."""

import pytest_asyncio

from disagg.router.config import PrefillEndpoint, RouterConfig
from disagg.router.server import RouterServer
from pd_cluster import start_pd, start_unified


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def unified():
    """A unified server (tiny model, dp 1): the reference every P/D answer must equal."""
    u = await start_unified()
    yield u
    await u.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def unified_url(unified):
    return f"http://127.0.0.1:{unified.port}"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster():
    """A prefill and a decode server (tiny model, dp 2 each, tcp KV transfers, no cluster secret); a
    module that needs another pair defines its own `cluster`."""
    c = await start_pd("tcp")
    yield c
    await c.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def router_url(cluster):
    """Our router in front of `cluster` (no health checks: both servers are up)."""
    router = RouterServer(RouterConfig(port=0, health_check_interval_s=0, decode=(cluster.decode_url,),
                                       prefill=(PrefillEndpoint(cluster.prefill_url, cluster.prefill.bootstrap_port),)))
    await router.start()
    yield router.url
    await router.close()
