"""vLLM's running/waiting gauges on /metrics are the workers' load at the scrape (the front asks
them), not their last twice-a-second report: 1 while a request decodes, 0 as soon as it answered or
its client left, on a real tiny engine slowed to 40 ms a step; back to 0 after 20 streams whose clients left."""

import asyncio
import re

import aiohttp
import pytest

from disagg.config import ServerConfig
from disagg.pd_config import DisaggConfig
from disagg.launch import start_server
from pd_cluster import TINY

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]
ENGINE0 = '{engine="0",model_name="tiny"}'


async def gauges(session: aiohttp.ClientSession, base: str) -> tuple[float, float]:
    async with session.get(base + "/metrics") as r:
        text = await r.text()
    values = dict(re.findall(r"^(vllm:num_requests_\w+)" + re.escape(ENGINE0) + r" (\S+)$", text, re.M))
    return float(values["vllm:num_requests_running"]), float(values["vllm:num_requests_waiting"])


async def settled(session: aiohttp.ClientSession, base: str) -> None:
    """The server notices closed connections and aborts their requests: the gauges reach (0, 0)."""
    for _ in range(150):
        if await gauges(session, base) == (0.0, 0.0):
            break
        await asyncio.sleep(0.02)
    assert await gauges(session, base) == (0.0, 0.0)


async def leave_after_first_token(base: str, body: dict) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(base + "/v1/completions", json=body) as r:
            async for line in r.content:
                if line.startswith(b"data: {"):
                    break


async def test_the_gauges_follow_a_request_at_once():
    server = await start_server(ServerConfig(port=0, dp_size=1, enable_fault_injection=True), TINY, DisaggConfig(),
                                lambda _: None)
    base = f"http://127.0.0.1:{server.port}"
    body = {"prompt": "Hi there", "max_tokens": 40, "ignore_eos": True, "stream": True}
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(base + "/faults", json={"fault": "slow_steps", "dp_rank": 0, "ms": 40}) as r:
                assert r.status == 200
            async with session.post(base + "/v1/completions", json=body) as r:
                chunks = 0
                async for line in r.content:
                    chunks += line.startswith(b"data: {")
                    if chunks == 3:
                        during = await gauges(session, base)
            assert (chunks, during) == (40, (1.0, 0.0))
            assert await gauges(session, base) == (0.0, 0.0)  # right after the answer: no report to wait for
            async with session.post(base + "/v1/completions", json=body) as r:
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        break  # the client leaves after the first token
            await settled(session, base)
            await asyncio.gather(*(leave_after_first_token(base, body) for _ in range(20)))
            await settled(session, base)  # 20 streams whose clients left: none running, none waiting
    finally:
        await server.close()
