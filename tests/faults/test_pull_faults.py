"""Pull-flow faults: a decode that gives up before it reads and during its read, and a prefill killed
while its ticket is out. Every block on both sides comes back, and the next request is served right.
(A draining prefill's leases: tests/e2e/test_drain_processes.py.)"""

import asyncio
import os
import signal
import time

import aiohttp
import pytest

from disagg.pd_config import ControlConfig
from pd_cluster import TINY, Cluster, pd_config, start_decode, start_pd, start_unified
from slow_reads import start_slow_prefill
from test_fencing import LONG, gauges, wait_gauges

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
        # Refused at the dead worker's address: at once, not at the connect timeout.
        assert status == 503 and data["error"]["message"] == (
            f"PeerUnavailable: cannot reach prefill {params['remote_host']}:{params['remote_port']}: its connection "
            "failed (no worker listens there)"), data
        assert await wait_gauges([cluster.decode], [idle[1]]) == [idle[1]]
        for _ in range(300):
            if cluster.prefill.controller.healthy():
                break
            await asyncio.sleep(0.1)
        assert await wait_gauges([cluster.prefill, cluster.decode], idle) == idle
    finally:
        await cluster.close()


async def test_a_decode_aborted_during_its_read_cuts_the_read_and_both_sides_get_every_block_back(tmp_path):
    marker = tmp_path / "read-in-flight"
    disagg = pd_config("tcp", kv_lease_s=30, waiting_timeout_s=20,
                       control=ControlConfig(heartbeat_interval_s=0.2, heartbeat_max_misses=3, connect_timeout_s=1))
    # Prefill rank 0 serves the READ of request "slow-read-1" 5 s late: the decode's read is in flight then.
    prefill = await start_slow_prefill(disagg, TINY, slow_tag=b"slow-read-1", marker=marker, delay_s=5.0)
    cluster = Cluster(prefill, await start_decode(disagg), aiohttp.ClientSession())
    try:
        idle = [[(w, 0) for w in side] for side in await cluster.free_blocks()]
        params = await ticket_with_id(cluster, "slow-read-1", 1)
        leased = [[(idle[0][0][0] - 27, 0), idle[0][1]]]  # LONG's KV: 27 blocks of 4 tokens, on rank 0
        assert (len(params["remote_block_ids"]), await wait_gauges([cluster.prefill], leased)) == (27, leased)
        leg = asyncio.create_task(cluster.post(cluster.decode_url + "/v1/completions",
                                               dict(BODY, kv_transfer_params=params, routed_dp_rank=0), None))
        deadline = time.monotonic() + 10
        while not marker.exists():  # the prefill got the READ frame: the decode claimed and posted its read
            assert time.monotonic() < deadline and not leg.done(), "the decode never read"
            await asyncio.sleep(0.01)
        aborted = time.monotonic()
        leg.cancel()  # the client leaves while the read is in flight
        await asyncio.gather(leg, return_exceptions=True)
        # The decode cuts its read off, then frees its blocks and releases the lease: long before the 5 s.
        assert await wait_gauges([cluster.prefill, cluster.decode], idle, timeout_s=4) == idle
        assert time.monotonic() - aborted < 4
        params = await ticket_with_id(cluster, "after-the-abort", 2)
        status, data, _ = await cluster.post(cluster.decode_url + "/v1/completions",
                                             dict(BODY, kv_transfer_params=params, routed_dp_rank=0), None)
        unified = await start_unified()
        try:
            _, expected, _ = await cluster.post(f"http://127.0.0.1:{unified.port}/v1/completions", BODY, None)
        finally:
            await unified.close()
        assert (status, data["choices"][0]["text"]) == (200, expected["choices"][0]["text"]), data
        assert await wait_gauges([cluster.prefill, cluster.decode], idle) == idle
    finally:
        await cluster.close()


async def test_an_expired_lease_frees_the_prefill_and_its_late_decode_fails_cleanly():
    cluster = await start_pd("tcp", server=FAST["server"], disagg=dict(FAST["disagg"], kv_lease_s=1.0))
    try:
        idle = [[(w, 0) for w in side] for side in await cluster.free_blocks()]
        params = await ticket(cluster, 0)
        leased = [[(idle[0][0][0] - 27, 0), idle[0][1]], idle[1]]
        assert await gauges_now(cluster) == leased
        granted = time.monotonic()
        assert await wait_gauges([cluster.prefill, cluster.decode], idle, timeout_s=5) == idle  # expired
        assert 1.0 <= time.monotonic() - granted < 3.0
        status, data, _ = await cluster.post(cluster.decode_url + "/v1/completions", dict(BODY, kv_transfer_params=params), None)
        request_id = params["remote_request_id"]
        assert (status, data["error"]["message"]) == (500, (
            f"TransferFailed: prefill 127.0.0.1:{params['remote_port']} refused the claim of {request_id}: "
            f"no blocks are leased for {request_id} (expired, released or never granted)"))
        assert await wait_gauges([cluster.prefill, cluster.decode], idle) == idle
        status, data, _ = await cluster.post(cluster.decode_url + "/v1/completions",
                                             dict(BODY, kv_transfer_params=await ticket(cluster, 0)), None)
        assert (status, data["usage"]["completion_tokens"]) == (200, 8), data
        assert await wait_gauges([cluster.prefill, cluster.decode], idle) == idle
    finally:
        await cluster.close()


async def gauges_now(cluster) -> list:
    return [await gauges(cluster.prefill), await gauges(cluster.decode)]


async def ticket_with_id(cluster, request_id: str, dispatch: int) -> dict:
    """A ticket for a request of the client's id `request_id`, the prefill's `dispatch`-th: its workers know
    it as `<id>-<dispatch>` (disagg/dp/worker_handle.py engine_msg)."""
    status, data, _ = await cluster.post(cluster.prefill_url + "/v1/completions", dict(
        BODY, max_tokens=1, kv_transfer_params=PULL, routed_dp_rank=0, request_id=request_id), None)
    assert status == 200, data
    assert (data["id"], data["kv_transfer_params"]["remote_request_id"]) == (request_id, f"{request_id}-{dispatch}")
    return data["kv_transfer_params"]
