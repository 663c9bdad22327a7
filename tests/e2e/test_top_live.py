"""`disagg top --once` against live servers: one server, and a P/D cluster behind our router (every
server and DP rank found through the router's /server_info)."""

import asyncio
import io

import pytest

from disagg import top
from disagg.router.config import PrefillEndpoint, RouterConfig
from disagg.router.server import RouterServer

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]


async def test_one_server(unified_url, cluster):
    await cluster.post(unified_url + "/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 4}}, None)
    for _ in range(50):  # the worker's counts reach the front a moment after the answer (5 s at most)
        out = io.StringIO()
        assert await top.run(unified_url, 1.0, once=True, out=out) == 0
        header, *table = out.getvalue().splitlines()
        if [row.split()[3] for row in table] == ["0"]:
            break
        await asyncio.sleep(0.1)
    assert header.split() == ["server", "role", "rank", "run", "wait", "kv%", "hit%", "tok/s", "ttft", "p50", "ttft",
                              "p99", "tpot", "p50", "tpot", "p99", "restarts"]
    assert [row.split()[:5] for row in table] == [[unified_url, "unified", "0", "0", "0"]]
    # kv% back to 0 after the request, no rate from one scrape, no restart (the last column)
    assert [(cells[5], cells[7], cells[-1]) for cells in (row.split() for row in table)] == [("0", "-", "0")]


async def test_a_cluster_behind_our_router(cluster):
    router = RouterServer(RouterConfig(port=0, health_check_interval_s=0, decode=(cluster.decode_url,),
                                       prefill=(PrefillEndpoint(cluster.prefill_url, cluster.prefill.bootstrap_port),)))
    await router.start()
    try:
        out = io.StringIO()
        assert await top.run(router.url, 1.0, once=True, out=out) == 0
    finally:
        await router.close()
    rows = [row.split() for row in out.getvalue().splitlines()[1:]]
    assert [cells[:3] for cells in rows] == [[cluster.prefill_url, "prefill", "0"], [cluster.prefill_url, "prefill", "1"],
                                             [cluster.decode_url, "decode", "0"], [cluster.decode_url, "decode", "1"]]
    assert [(cells[3], cells[4], cells[7], cells[-1]) for cells in rows] == [("0", "0", "-", "0")] * 4
