"""`disagg serve --max-waiting-requests` on real processes (tiny model): both servers of the
one-command cluster carry the limit, and while a request waits the client gets the decode's 429 with
its Retry-After through the router at once; once it is gone, requests are served again and every
block is back."""

import asyncio

import aiohttp
import pytest

from disagg.api.admission import num_waiting_requests
from disagg.cluster import ClusterOptions, drain_cluster, start_cluster
from disagg.config import ServerConfig
from pd_cluster import TINY, pd_config, until

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]
REQUEST = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 3, "temperature": 0}
REFUSAL = {"error": {"message": "the server has 1 requests waiting, its limit (--max-waiting-requests 1): retry later",
                     "type": "RateLimitError", "param": None, "code": "too_many_waiting_requests"}}


async def free_blocks(server) -> list[int]:
    return [w.num_free_blocks for w in await server.controller.call_utility("stats")]


async def test_a_cluster_with_a_waiting_limit_refuses_through_its_router_while_one_waits():
    prefill, decode, router = await start_cluster(TINY, pd_config("tcp"), ClusterOptions(
        port=0, servers=ServerConfig(dp_size=1, max_waiting_requests=1)))
    decode_url = f"http://127.0.0.1:{decode.port}/v1/completions"
    try:
        assert (prefill.controller.server.max_waiting_requests, decode.controller.server.max_waiting_requests) == (1, 1)
        baseline = (await free_blocks(prefill), await free_blocks(decode))
        async with aiohttp.ClientSession() as session:
            # A decode leg whose prefill never comes: it waits for its KV until aborted.
            orphan = dict(REQUEST, request_id="orphan", bootstrap_host="127.0.0.1",
                          bootstrap_port=prefill.bootstrap_port, bootstrap_room=4242)
            waiting = asyncio.create_task(session.post(decode_url, json=orphan))
            await until(lambda: num_waiting_requests(decode.controller.worker_states()) == 1, "the decode's report")
            async with session.post(f"{router.url}/v1/completions", json=REQUEST) as r:
                assert (r.status, r.headers["Retry-After"], await r.json()) == (429, "1", REFUSAL)
            async with session.post(f"http://127.0.0.1:{decode.port}/abort_request", json={"rid": "orphan"}) as r:
                assert r.status == 200
            async with await waiting as r:
                assert (r.status, (await r.json())["choices"][0]["finish_reason"]) == (200, "abort")
            await until(lambda: num_waiting_requests(decode.controller.worker_states()) == 0, "the decode's report")
            async with session.post(f"{router.url}/v1/completions", json=REQUEST) as r:
                assert (r.status, (await r.json())["usage"]["completion_tokens"]) == (200, 3)
        for _ in range(250):  # the prefill frees its blocks once the decode confirmed the transfer
            if (now := (await free_blocks(prefill), await free_blocks(decode))) == baseline:
                break
            await asyncio.sleep(0.02)
        assert now == baseline
    finally:
        await drain_cluster(prefill, decode, router, 0)
