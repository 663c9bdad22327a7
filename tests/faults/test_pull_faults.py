"""Pull-flow faults: a decode that gives up before it reads, and a prefill killed while its ticket
is out. Every block on both sides comes back."""

import asyncio
import os
import signal

import pytest

from disagg.config import ControlConfig
from pd_cluster import start_pd
from test_fencing import LONG, wait_gauges

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(180)]
GREEDY = {"temperature": 0, "ignore_eos": True}
PULL = {"do_remote_decode": True}
FAST = dict(server={"worker_restart_backoff_s": 0.3, "worker_restart_max_backoff_s": 2.0},
            disagg={"kv_lease_s": 30, "waiting_timeout_s": 5,
                    "control": ControlConfig(heartbeat_interval_s=0.2, heartbeat_max_misses=3, connect_timeout_s=1)})
BODY = {"model": "tiny", "prompt": LONG, "max_tokens": 8, **GREEDY}


async def ticket(cluster, rank: int) -> dict:
    status, data, _ = await cluster.post(cluster.prefill_url + "/v1/completions",
                                         dict(BODY, max_tokens=1, kv_transfer_params=PULL, routed_dp_rank=rank), None)
    assert status == 200, data
    return data["kv_transfer_params"]


async def test_a_decode_that_gives_up_before_reading_releases_the_lease():
    cluster = await start_pd("tcp", **FAST)
    try:
        idle = [[(w, 0) for w in side] for side in await cluster.free_blocks()]
        params = await ticket(cluster, 0)
        worker = cluster.prefill.controller.workers[0].process.pid
        os.kill(worker, signal.SIGSTOP)  # the decode cannot claim: its client will leave first
        try:
            leg = asyncio.create_task(cluster.post(cluster.decode_url + "/v1/completions",
                                                   dict(BODY, kv_transfer_params=params), None))
            await asyncio.sleep(0.3)
            leg.cancel()
            await asyncio.gather(leg, return_exceptions=True)
            assert await wait_gauges([cluster.decode], [idle[1]]) == [idle[1]]
        finally:
            os.kill(worker, signal.SIGCONT)
        # The lease (30 s) is released by the decode's Release, not by its expiry.
        assert await wait_gauges([cluster.prefill, cluster.decode], idle, timeout_s=10) == idle
    finally:
        await cluster.close()


async def test_a_prefill_killed_while_its_ticket_is_out():
    cluster = await start_pd("tcp", **FAST)
    try:
        idle = [[(w, 0) for w in side] for side in await cluster.free_blocks()]
        params = await ticket(cluster, 0)
        os.kill(cluster.prefill.controller.workers[0].process.pid, signal.SIGKILL)
        status, data, _ = await cluster.post(cluster.decode_url + "/v1/completions", dict(BODY, kv_transfer_params=params), None)
        assert status == 503 and data["error"]["message"].startswith(f"PeerUnavailable: cannot reach prefill 127.0.0.1:"), data
        assert await wait_gauges([cluster.decode], [idle[1]]) == [idle[1]]
        for _ in range(300):
            if cluster.prefill.controller.healthy():
                break
            await asyncio.sleep(0.1)
        assert await wait_gauges([cluster.prefill, cluster.decode], idle) == idle
    finally:
        await cluster.close()
