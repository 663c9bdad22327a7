"""`disagg unified` with real engine workers: the openai SDK, disconnects, utilities that
disagree or fail for real, a dead worker, and the default model answering in English."""

import asyncio
import json
import os
import re
import signal

import aiohttp
import openai
import pytest
import pytest_asyncio

from disagg.config import ServerConfig
from disagg.pd_config import DisaggConfig
from disagg.launch import start_server
from kernel_summary import HUGE_PAGES_CLAUSE, auto_kernels, cpu_summary, dense_kernel, split_huge_pages
from pd_cluster import TINY

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server():
    running = await start_server(ServerConfig(port=0, dp_size=2, load_balance_method="round_robin"), TINY, DisaggConfig(), lambda _: None)
    yield running
    await running.close()


def url(server) -> str:
    return f"http://127.0.0.1:{server.port}"


async def free_blocks(session, server) -> dict[str, float]:
    async with session.get(url(server) + "/metrics") as r:
        text = await r.text()
    return {rank: float(v) for rank, v in re.findall(r'^disagg_num_free_blocks\{dp_rank="(\d)"\} (\S+)$', text, re.M)}


async def test_openai_sdk_streams_a_chat_completion(server):
    client = openai.AsyncOpenAI(base_url=url(server) + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "Say something"}]
    full = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    stream = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                  stream=True, stream_options={"include_usage": True})
    pieces, usage = [], None
    async for chunk in stream:
        pieces += [c.delta.content or "" for c in chunk.choices]
        usage = chunk.usage or usage
    assert "".join(pieces) == full.choices[0].message.content
    assert usage.completion_tokens == full.usage.completion_tokens
    await client.close()


async def test_server_info_says_which_dtype_and_kernels_the_workers_chose(server):
    async with aiohttp.ClientSession() as s, s.get(url(server) + "/server_info") as r:
        info = await r.json()
    engine, pages = split_huge_pages(info["engine"])
    assert engine == (f"{cpu_summary()}, dtype float32 (set by --dtype), {auto_kernels()}, "
                      "quantization none (auto: not a .gguf file): "
                      f"9 float32 dense ({dense_kernel()}), kv cache float32 (auto: the model's dtype)")
    assert re.fullmatch(HUGE_PAGES_CLAUSE, pages), pages


async def test_client_disconnect_mid_stream_frees_its_blocks(server):
    async with aiohttp.ClientSession() as s:
        for _ in range(40):
            start = await free_blocks(s, server)
            if start == {"0": 96.0, "1": 96.0}:
                break
            await asyncio.sleep(0.1)
        body = {"text": "x" * 40, "sampling_params": {"max_new_tokens": 340, "temperature": 0, "ignore_eos": True},
                "stream": True, "routed_dp_rank": 1}
        async with s.post(url(server) + "/generate", json=body) as resp:
            await resp.content.readline()
            [stats] = await server.controller.call_utility("stats", ranks=[1])
            assert stats.num_running == 1 and stats.num_free_blocks < 96  # still generating: holds blocks
        for _ in range(50):
            if await free_blocks(s, server) == start:
                break
            await asyncio.sleep(0.1)
        assert await free_blocks(s, server) == start == {"0": 96.0, "1": 96.0}


async def test_workers_that_disagree_on_sleeping_give_500(server):
    await server.controller.call_utility("sleep", 1, ranks=[1])
    async with aiohttp.ClientSession() as s:
        async with s.get(url(server) + "/is_sleeping") as r:
            data = await r.json()
        assert (r.status, data["error"]["type"]) == (500, "InconsistentUtilityResults")
        assert data["error"]["message"] == "is_sleeping: DP workers disagree (dp_rank 0: False, dp_rank 1: True)"
        async with s.post(url(server) + "/wake_up") as r:
            assert r.status == 200
        async with s.get(url(server) + "/is_sleeping") as r:
            assert (r.status, await r.json()) == (200, {"is_sleeping": False})


async def test_reset_prefix_cache_fails_naming_the_busy_worker(server):
    async with aiohttp.ClientSession() as s:
        body = {"text": "y" * 20, "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True},
                "stream": True, "routed_dp_rank": 0}
        async with s.post(url(server) + "/generate", json=body) as resp:
            await resp.content.readline()  # worker 0 holds blocks: it refuses to reset
            async with s.post(url(server) + "/reset_prefix_cache") as r:
                data = await r.json()
        assert r.status == 500
        assert data["error"]["message"] == "reset_prefix_cache failed on 1 DP worker(s) (dp_rank 0: returned False)"


async def test_dead_worker_turns_health_red_and_its_requests_get_503(server):
    os.kill(server.controller.workers[1].process.pid, signal.SIGKILL)
    async with aiohttp.ClientSession() as s:
        for _ in range(40):
            async with s.get(url(server) + "/health") as r:
                health = await r.text()
                if health:
                    break
            await asyncio.sleep(0.1)
        # Degraded, still in rotation: worker 0 serves while worker 1 restarts.
        assert (r.status, json.loads(health)) == (200, {
            "status": "degraded", "message": "DP workers down: dp_rank 1 dead", "dp_ranks_down": [1]})
        body = {"text": "z", "sampling_params": {"max_new_tokens": 2}, "routed_dp_rank": 1}
        async with s.post(url(server) + "/generate", json=body) as r:
            assert r.status == 503
            message = (await r.json())["error"]["message"]
            assert message.startswith("DP worker 1 is not available: it "), message  # died, or is restarting
        async with s.post(url(server) + "/generate", json=dict(body, routed_dp_rank=0)) as r:
            assert r.status == 200  # the other worker still serves
