"""kill -9 of one DP worker: the server stays in rotation, requests needing the dead rank fail fast
with a 503 naming it, the worker comes back under a new identity, and every block is free again."""

import asyncio
import json
import os
import signal
import time

import aiohttp
import pytest

from disagg.config import ServerConfig
from disagg.pd_config import ControlConfig, DisaggConfig
from disagg.launch import start_server
from pd_cluster import TINY, start_pd, start_unified

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(180)]
GREEDY = {"temperature": 0, "ignore_eos": True}
FAST = dict(server={"worker_restart_backoff_s": 0.3, "worker_restart_max_backoff_s": 2.0},
            disagg={"waiting_timeout_s": 10, "bootstrap_timeout_s": 10,
                    "control": ControlConfig(heartbeat_interval_s=0.2, heartbeat_max_misses=3, connect_timeout_s=2)})


async def wait_for(predicate, timeout_s: float, interval_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await predicate():
            return True
        await asyncio.sleep(interval_s)
    return False


async def health(cluster, url):
    async with cluster.session.get(url + "/health") as r:
        return r.status, await r.text()


def body(text: str) -> dict:
    return {"text": text, "sampling_params": {"max_new_tokens": 6, **GREEDY}}


async def test_kill_prefill_worker_restarts_it_and_the_cluster_keeps_serving():
    unified = await start_unified()
    cluster = await start_pd("tcp", **FAST)
    try:
        async with cluster.session.post(f"http://127.0.0.1:{unified.port}/generate", json=body("kill me")) as r:
            expected = (await r.json())["output_ids"]
        before = await cluster.free_blocks()
        old_pid = cluster.prefill.controller.workers[0].process.pid
        os.kill(old_pid, signal.SIGKILL)
        assert await wait_for(lambda: _degraded(cluster), 5)
        # A room of rank 1 is served meanwhile; so is a room of rank 0: the prefill places it on rank 1
        # and registers it, and the decode, unable to reach rank 0, finds it in the registry.
        ok = cluster.pd_body(body("kill me"), room=2 * 11 + 1)
        (p1, _, _), (d1, d1_data, _) = await cluster.post_both("/generate", ok, ok)
        assert (p1, d1, d1_data["output_ids"]) == (200, 200, expected)
        moved = cluster.pd_body(body("kill me"), room=2 * 11)
        (p0, p0_data, _), (d0, d0_data, _) = await cluster.post_both("/generate", moved, moved)
        assert (p0, p0_data["meta_info"]["dp_rank"], d0, d0_data["output_ids"]) == (200, 1, 200, expected)
        # Pinned to the dead rank, it fails at once, naming the rank.
        down = cluster.pd_body(body("kill me"), room=2 * 12)
        start = time.monotonic()
        status, data, _ = await cluster.post(cluster.prefill_url + "/generate", dict(down, routed_dp_rank=0), None)
        assert status == 503 and data["error"]["message"].startswith("DP worker 0 is not available: ")
        assert time.monotonic() - start < 1
        # The next incarnation: a new process, registered again; rank 0 serves again.
        assert await wait_for(lambda: _healthy(cluster), 60, 0.2)
        assert cluster.prefill.controller.workers[0].process.pid != old_pid
        assert [w.num_restarts for w in cluster.prefill.controller.worker_states()] == [1, 0]
        again = cluster.pd_body(body("kill me"), room=2 * 12)
        (p2, _, _), (d2, d2_data, _) = await cluster.post_both("/generate", again, again)
        assert (p2, d2, d2_data["output_ids"]) == (200, 200, expected)
        assert await cluster.free_blocks() == before
    finally:
        await cluster.close()
        await unified.close()


async def test_kill_decode_worker_restarts_it_under_a_new_identity():
    cluster = await start_pd("tcp", **FAST)
    try:
        before = await cluster.free_blocks()
        first = cluster.pd_body(body("decode dies"), room=2 * 5)
        (_, _, _), (d0, d0_data, _) = await cluster.post_both("/generate", first, dict(first, routed_dp_rank=0))
        assert d0 == 200
        os.kill(cluster.decode.controller.workers[0].process.pid, signal.SIGKILL)
        assert await wait_for(lambda: _degraded(cluster, cluster.decode_url), 5)
        pinned = cluster.pd_body(body("decode dies"), room=2 * 6)
        status, data, _ = await cluster.post(cluster.decode_url + "/generate", dict(pinned, routed_dp_rank=0), None)
        assert status == 503 and data["error"]["message"].startswith("DP worker 0 is not available: ")
        assert await wait_for(lambda: _healthy(cluster, cluster.decode_url), 60, 0.2)
        again = cluster.pd_body(body("decode dies"), room=2 * 7)
        (p1, _, _), (d1, d1_data, _) = await cluster.post_both("/generate", again, dict(again, routed_dp_rank=0))
        assert (p1, d1, d1_data["output_ids"]) == (200, 200, d0_data["output_ids"])
        assert await cluster.free_blocks() == before
    finally:
        await cluster.close()


async def _degraded(cluster, url=None):
    status, text = await health(cluster, url or cluster.prefill_url)
    return status == 200 and '"status":"degraded"' in text.replace(" ", "")


async def _healthy(cluster, url=None):
    return await health(cluster, url or cluster.prefill_url) == (200, "")


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_kill_one_worker_of_two_while_requests_arrive_through_our_router_loses_none(role):
    """20 requests over 2 s through our router; one DP worker of `role` is killed after the fifth.
    Every request answers 200 with the unified tokens (a leg that failed before any byte reached the
    client is sent again on a fresh room; a room whose prefill rank is down is placed on the live
    one), and every gauge is back at its start once the worker restarted."""
    from disagg.router.config import PrefillEndpoint, RouterConfig
    from disagg.router.server import RouterServer

    unified = await start_unified()
    cluster = await start_pd("tcp", **FAST)
    router = RouterServer(RouterConfig(port=0, health_check_interval_s=0, retry_max_retries=2,
                                       prefill=(PrefillEndpoint(cluster.prefill_url, cluster.prefill.bootstrap_port),),
                                       decode=(cluster.decode_url,)))
    await router.start()
    try:
        texts = [f"request {i} of twenty" for i in range(20)]
        expected = []
        for text in texts:
            async with cluster.session.post(f"http://127.0.0.1:{unified.port}/generate", json=body(text)) as r:
                expected.append((await r.json())["output_ids"])
        before = await cluster.free_blocks()
        server, url = (cluster.prefill, cluster.prefill_url) if role == "prefill" else (cluster.decode, cluster.decode_url)

        async def send(i: int):
            await asyncio.sleep(0.1 * i)
            if i == 5:
                os.kill(server.controller.workers[1].process.pid, signal.SIGKILL)
            async with cluster.session.post(router.url + "/generate", json=body(texts[i])) as r:
                return r.status, (await r.json()).get("output_ids")

        answers = await asyncio.gather(*(send(i) for i in range(20)))
        assert answers == [(200, ids) for ids in expected]
        assert await wait_for(lambda: _healthy(cluster, url), 60, 0.2)
        assert [w.num_restarts for w in server.controller.worker_states()] == [0, 1]
        assert await cluster.settled(before, timeout_s=10) == before
    finally:
        await router.close()
        await cluster.close()
        await unified.close()



TOKENS_BODY = {"token_ids": [5, 9, 17, 33, 65, 3], "sampling_params": {"max_tokens": 300, **GREEDY}}


async def stream_token_ids(session, url: str, body: dict, kill_after: int, kill) -> list[list[int]]:
    """The token ids of each streamed chunk of /inference/v1/generate; `kill()` once `kill_after` came."""
    chunks, killed = [], False
    async with session.post(url + "/inference/v1/generate", json=dict(body, stream=True)) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if line.startswith(b"data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                chunks += [c["token_ids"] for c in event["choices"] if c["token_ids"]]
            if not killed and sum(map(len, chunks)) >= kill_after:
                kill()
                killed = True
    assert killed
    return chunks


async def test_kill_a_unified_worker_mid_stream_the_stream_goes_on_on_the_other():
    """Migration: the prompt and the 5+ tokens already streamed are computed again on the other
    worker, which streams only what follows: one stream, exactly the tokens of an undisturbed run."""
    server = await start_server(ServerConfig(port=0, dp_size=2, **FAST["server"]), TINY, DisaggConfig(), lambda _: None)
    try:
        url = f"http://127.0.0.1:{server.port}"
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/inference/v1/generate", json=TOKENS_BODY) as r:
                expected = (await r.json())["choices"][0]["token_ids"]
            pid = server.controller.workers[0].process.pid
            chunks = await stream_token_ids(session, url, dict(TOKENS_BODY, routed_dp_rank=0), 5,
                                            lambda: os.kill(pid, signal.SIGKILL))
        assert [t for chunk in chunks for t in chunk] == expected and len(expected) == 300
        assert await wait_for(lambda: _restarted(server), 60, 0.2)
    finally:
        await server.close()


async def test_kill_a_decode_worker_mid_stream_the_stream_completes_with_the_unified_tokens():
    unified = await start_unified()
    cluster = await start_pd("tcp", **FAST)
    try:
        async with cluster.session.post(f"http://127.0.0.1:{unified.port}/inference/v1/generate", json=TOKENS_BODY) as r:
            expected = (await r.json())["choices"][0]["token_ids"]
        before = await cluster.free_blocks()
        pd = cluster.pd_body(TOKENS_BODY)
        pid = cluster.decode.controller.workers[0].process.pid
        prefill = asyncio.create_task(cluster.post(cluster.prefill_url + "/inference/v1/generate", pd, None))
        chunks = await stream_token_ids(cluster.session, cluster.decode_url, dict(pd, routed_dp_rank=0), 5,
                                        lambda: os.kill(pid, signal.SIGKILL))
        assert (await prefill)[0] == 200
        assert [t for chunk in chunks for t in chunk] == expected
        assert await wait_for(lambda: _restarted(cluster.decode), 60, 0.2)
        assert await cluster.settled(before, timeout_s=10) == before
    finally:
        await cluster.close()
        await unified.close()


async def _restarted(server) -> bool:
    return [w.num_restarts for w in server.controller.worker_states()] == [1, 0] and server.controller.healthy()
