"""--itl-objective-ms on a decode (decode/pace.py): a request whose KV landed starts, and sends its
first token, only while fewer requests run than the decode's own measured steps keep within the
objective. With an objective no step meets, the pace is one request: a second request's first token
comes after the first request's last, where without it the two decode together. Both answer with the
unified server's greedy text, and every block is free afterwards."""

import asyncio
import json

import aiohttp
import pytest

from pd_cluster import TINY, start_pd, start_unified

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]
GREEDY = {"model": "tiny", "temperature": 0, "ignore_eos": True}


async def stream(session: aiohttp.ClientSession, url: str, body: dict, name: str, events: list) -> str:
    """The streamed text; each chunk noted in `events` as (name, index) in arrival order."""
    text, index = [], 0
    async with session.post(url + "/v1/completions", json=dict(body, stream=True)) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if line.startswith(b"data: {"):
                text.append(json.loads(line[6:])["choices"][0]["text"])
                events.append((name, index))
                index += 1
    return "".join(text)


@pytest.mark.parametrize("objective_ms", [0.0, 0.001])
async def test_a_paced_decode_starts_the_next_request_once_a_slot_is_free(objective_ms):
    from disagg.router.config import PrefillEndpoint, RouterConfig
    from disagg.router.server import RouterServer

    cluster = await start_pd("tcp", dp_size=1, server={"enable_fault_injection": True},
                             decode_options={"itl_objective_ms": objective_ms})
    unified = await start_unified(TINY)
    router = RouterServer(RouterConfig(port=0, health_check_interval_s=0, decode=(cluster.decode_url,),
                                       prefill=(PrefillEndpoint(cluster.prefill_url, cluster.prefill.bootstrap_port),)))
    first = dict(GREEDY, prompt="The first request decodes for a while", max_tokens=30)
    second = dict(GREEDY, prompt="A second one arrives meanwhile", max_tokens=6)
    try:
        await router.start()
        wants = []
        for body in (first, second):
            async with cluster.session.post(f"http://127.0.0.1:{unified.port}/v1/completions", json=body) as r:
                wants.append((await r.json())["choices"][0]["text"])
        baseline = await cluster.free_blocks()
        events: list = []
        await stream(cluster.session, router.url, dict(first, max_tokens=20), "warm", events)  # 20 steps: the pace learnt
        async with cluster.session.post(cluster.decode_url + "/faults",
                                        json={"fault": "slow_steps", "dp_rank": 0, "ms": 20}) as r:
            assert r.status == 200
        events.clear()
        a = asyncio.create_task(stream(cluster.session, router.url, first, "A", events))
        deadline = asyncio.get_running_loop().time() + 30
        while len(events) < 2 and not a.done():  # the first request decoding (or over: its error shows below)
            assert asyncio.get_running_loop().time() < deadline, events
            await asyncio.sleep(0.005)
        b = await stream(cluster.session, router.url, second, "B", events)
        assert [await a, b] == wants
        a_last, b_first = events.index(("A", 29)), events.index(("B", 0))
        assert (b_first > a_last) is (objective_ms > 0), events  # paced: one at a time; else together
        for _ in range(100):
            if await cluster.free_blocks() == baseline:
                break
            await asyncio.sleep(0.05)
        assert await cluster.free_blocks() == baseline
    finally:
        await router.close()
        await cluster.close()
        await unified.close()
