"""kill -9 of one DP worker: the server stays in rotation, requests needing the dead rank fail fast
with a 503 naming it, the worker comes back under a new identity, and every block is free again."""

import asyncio
import os
import signal
import time

import pytest

from disagg.config import ControlConfig
from pd_cluster import start_pd, start_unified

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
        # A room of rank 1 is served meanwhile; a room of rank 0 fails at once, naming the rank.
        ok = cluster.pd_body(body("kill me"), room=2 * 11 + 1)
        (p1, _, _), (d1, d1_data, _) = await cluster.post_both("/generate", ok, ok)
        assert (p1, d1, d1_data["output_ids"]) == (200, 200, expected)
        down = cluster.pd_body(body("kill me"), room=2 * 11)
        start = time.monotonic()
        status, data, _ = await cluster.post(cluster.prefill_url + "/generate", down, None)
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
