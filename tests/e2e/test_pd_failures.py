"""P/D failures end requests with their reason, never a hang, and free blocks on both sides."""

import asyncio
import os
import re
import signal
import time

import pytest

from disagg.pd_config import ControlConfig
from pd_cluster import start_pd

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]
GREEDY = {"temperature": 0, "ignore_eos": True}


async def test_prefill_leg_disconnect_fails_the_decode_and_frees_both_sides():
    cluster = await start_pd("tcp")
    try:
        before = await cluster.free_blocks()
        # The prefill leg only: the prefill holds its blocks waiting for a decode that never comes.
        body = cluster.pd_body({"text": "p" * 30, "sampling_params": {"max_new_tokens": 4, **GREEDY}})
        leg = asyncio.create_task(cluster.post(cluster.prefill_url + "/generate", body, None))
        for _ in range(100):
            prefill_free, _ = await cluster.free_blocks()
            if prefill_free != before[0]:
                break
            await asyncio.sleep(0.02)
        assert prefill_free != before[0]
        leg.cancel()  # the client of the prefill leg goes away
        for _ in range(100):
            if await cluster.free_blocks() == before:
                break
            await asyncio.sleep(0.05)
        assert await cluster.free_blocks() == before
        # The decode leg that shows up late learns the room failed (no 30 s wait).
        start = time.monotonic()
        async with cluster.session.post(cluster.decode_url + "/generate", json=body) as r:
            data = await r.json()
        assert (r.status, data["error"]["message"]) == (500, "aborted on the prefill side")
        assert time.monotonic() - start < 10
        assert await cluster.free_blocks() == before
    finally:
        await cluster.close()


async def test_a_dead_prefill_worker_fails_waiting_decodes_with_lost_connection():
    cluster = await start_pd("tcp")
    try:
        before = await cluster.free_blocks()
        room = 2 * 777  # follow_bootstrap_room: prefill DP rank 0
        body = cluster.pd_body({"text": "q" * 30, "sampling_params": {"max_new_tokens": 4, **GREEDY}}, room)
        # Warm the decode's control stream to prefill rank 0, send only the decode leg and, once it waits
        # for its KV (its blocks reserved), kill that worker. (Killed first, the decode may see the stream
        # close before the request comes: then the request is no waiting decode.)
        await cluster.post_both("/generate", body, body)
        warm = await cluster.free_blocks()
        waiting = cluster.pd_body(body, room + 2)  # a room of its own, on prefill rank 0 as well
        leg = asyncio.create_task(cluster.post(cluster.decode_url + "/generate", waiting, None))
        for _ in range(100):
            if (await cluster.free_blocks())[1] != warm[1]:
                break
            await asyncio.sleep(0.02)
        assert (await cluster.free_blocks())[1] != warm[1], "the decode leg never reserved its blocks"
        os.kill(cluster.prefill.controller.workers[0].process.pid, signal.SIGKILL)
        start = time.monotonic()
        status, data, _ = await leg
        elapsed = time.monotonic() - start
        assert status == 503, data
        assert data["error"]["message"].startswith("lost connection to prefill 127.0.0.1:")
        assert elapsed < 10  # heartbeats: 3 misses at 1 s, not the 30 s waiting deadline
        # The lost prefill is cut off (tcp), then the quarantined blocks go back.
        for _ in range(40):
            stats = await cluster.decode.controller.call_utility("stats")
            if [w.num_free_blocks for w in stats] == before[1]:
                break
            await asyncio.sleep(0.05)
        assert [(w.num_free_blocks, w.num_quarantined_blocks) for w in stats] == [(b, 0) for b in before[1]]
    finally:
        await cluster.close()


async def test_a_decode_for_a_room_on_a_dead_prefill_worker_fails_at_once_not_at_the_connect_timeout():
    # The registry holds the room on rank 0 (the prefill balances round robin: every room is registered)
    # and, the worker staying dead (restart backoff 60 s), still names rank 0's address; the decode's
    # stream to it closed before this request came. The connection is refused: 503 at once, not after
    # the 30 s connect timeout.
    control = ControlConfig(heartbeat_interval_s=0.2, heartbeat_max_misses=3, connect_timeout_s=30)
    cluster = await start_pd("tcp", prefill_method="round_robin", disagg={"control": control},
                             server={"worker_restart_backoff_s": 60, "worker_restart_max_backoff_s": 60})
    try:
        before = await cluster.free_blocks()
        body = cluster.pd_body({"text": "r" * 30, "sampling_params": {"max_new_tokens": 4, **GREEDY}})
        await cluster.post_both("/generate", dict(body, routed_dp_rank=0), body)  # the decode's stream to rank 0 opens
        os.kill(cluster.prefill.controller.workers[0].process.pid, signal.SIGKILL)
        await asyncio.sleep(1.0)  # the stream closes at once (at most 3 heartbeats of 0.2 s)
        start = time.monotonic()
        status, data, _ = await cluster.post(cluster.decode_url + "/generate", body, None)
        elapsed = time.monotonic() - start
        assert status == 503, data
        assert re.fullmatch(r"PeerUnavailable: cannot reach prefill 127\.0\.0\.1:\d+: its connection failed "
                            r"\(no worker listens there\)", data["error"]["message"]), data
        assert elapsed < 15, elapsed  # at once: the connect timeout is 30 s
        for _ in range(40):  # the decode's reserved blocks go back (nothing was written into them)
            stats = await cluster.decode.controller.call_utility("stats")
            if [w.num_free_blocks for w in stats] == before[1]:
                break
            await asyncio.sleep(0.05)
        assert [(w.num_free_blocks, w.num_quarantined_blocks) for w in stats] == [(b, 0) for b in before[1]]
    finally:
        await cluster.close()


async def test_sleep_is_refused_on_pd_workers_with_the_reason():
    cluster = await start_pd("tcp")
    try:
        async with cluster.session.post(cluster.decode_url + "/sleep", json={"level": 1}) as r:
            data = await r.json()
        assert r.status == 500
        reason = ("InvalidRequest: sleep is not supported on prefill/decode workers: their KV cache is registered "
                  "with the transfer backend and its peers")
        assert data["error"]["message"] == f"sleep failed on 2 DP worker(s) (dp_rank 0: {reason}, dp_rank 1: {reason})"
        async with cluster.session.get(cluster.decode_url + "/is_sleeping") as r:
            assert await r.json() == {"is_sleeping": False}
    finally:
        await cluster.close()


async def test_a_full_decode_cache_queues_requests_instead_of_failing_them():
    from dataclasses import replace

    from disagg.engine_config import CacheConfig
    from pd_cluster import TINY

    small = replace(TINY, cache=CacheConfig(num_blocks=30, block_size=4))  # 120 tokens: one long request at a time
    cluster = await start_pd("tcp", engine=small)
    try:
        prompt = "queue me up, " * 8  # 105 tokens with BOS: 27 of the 30 blocks
        bodies = [cluster.pd_body({"text": prompt, "sampling_params": {"max_new_tokens": 8, **GREEDY}}) for _ in range(3)]
        # All three on decode worker 0, which holds one of them at a time: two wait in its queue.
        results = await asyncio.gather(*(cluster.post_both("/generate", b, dict(b, routed_dp_rank=0)) for b in bodies))
        assert [(p[0], d[0]) for p, d in results] == [(200, 200)] * 3, results
        outputs = [d[1]["output_ids"] for _, d in results]
        assert outputs[0] == outputs[1] == outputs[2] and len(outputs[0]) == 8
        assert await cluster.free_blocks() == ([30, 30], [30, 30])
    finally:
        await cluster.close()
