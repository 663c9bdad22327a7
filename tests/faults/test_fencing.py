"""No KV block is reused while a peer may still write into it: a stalled or killed prefill is cut
off before the decode's reserved blocks go back, and the next requests' outputs equal unified."""

import asyncio
import os
import signal
import time

import pytest

from disagg.pd_config import ControlConfig
from pd_cluster import start_pd, start_unified

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(180)]
GREEDY = {"temperature": 0, "ignore_eos": True}
LONG = "The quick brown fox jumps over the lazy dog, twice: " * 2  # > 100 tokens: chunked prefill
PROMPTS = [LONG, "Pack my box with five dozen liquor jugs. " * 3, "hello there, " * 9, LONG[::-1]]
FAST = dict(server={"worker_restart_backoff_s": 0.3, "worker_restart_max_backoff_s": 2.0},
            disagg={"waiting_timeout_s": 3, "bootstrap_timeout_s": 5, "transfer_timeout_s": 5, "abort_ack_timeout_s": 1,
                    "control": ControlConfig(heartbeat_interval_s=0.2, heartbeat_max_misses=3, connect_timeout_s=2)})


def body(text: str, max_tokens: int = 8) -> dict:
    return {"text": text, "sampling_params": {"max_new_tokens": max_tokens, **GREEDY}}


async def unified_outputs(texts: list[str]) -> list[list[int]]:
    unified = await start_unified()
    try:
        import aiohttp

        async with aiohttp.ClientSession() as s:
            outs = []
            for text in texts:
                async with s.post(f"http://127.0.0.1:{unified.port}/generate", json=body(text)) as r:
                    outs.append((await r.json())["output_ids"])
            return outs
    finally:
        await unified.close()


async def gauges(server) -> list[tuple[int, int]]:
    """(free, quarantined) blocks of every worker of one server."""
    return [(w.num_free_blocks, w.num_quarantined_blocks) for w in await server.controller.call_utility("stats")]


async def wait_gauges(servers, expected, timeout_s: float = 5.0):
    """Poll the gauges of `servers` until they read `expected` (or the deadline); the last reading."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = [await gauges(s) for s in servers]
        if now == expected or time.monotonic() > deadline:
            return now
        await asyncio.sleep(0.05)


async def same_worker_outputs(cluster, texts, room_base):
    """Each text through prefill rank 0 and decode worker 0 (the blocks the fault touched)."""
    outs = []
    for i, text in enumerate(texts):
        pd = cluster.pd_body(body(text), room=2 * (room_base + i))
        (p, _, _), (d, data, _) = await cluster.post_both("/generate", pd, dict(pd, routed_dp_rank=0))
        assert (p, d) == (200, 200), data
        outs.append(data["output_ids"])
    return outs


async def wait_for_prefill_to_hold_blocks(cluster, idle):
    """Until prefill worker 0 has blocks allocated (it computes, or holds them for the decode)."""
    for _ in range(400):
        if (await cluster.prefill.controller.call_utility("stats", ranks=[0]))[0].num_free_blocks < idle[0][0][0]:
            return
        await asyncio.sleep(0.002)
    raise AssertionError("prefill worker 0 never started the request")


async def test_prefill_stopped_past_the_decode_deadline_then_resumed_never_writes_reused_blocks():
    expected = await unified_outputs(PROMPTS)
    cluster = await start_pd("tcp", **FAST)
    try:
        idle = [[(w, 0) for w in side] for side in await cluster.free_blocks()]
        assert await same_worker_outputs(cluster, PROMPTS[:1], 100) == expected[:1]  # streams up, warm
        worker = cluster.prefill.controller.workers[0].process.pid
        pd = cluster.pd_body(body(LONG, 64), room=2 * 7)
        # The prefill computes and holds the prompt's blocks, then stops before its decode's
        # destination arrives: the TransferInfo waits in its socket while the decode gives up.
        prefill_leg = asyncio.create_task(cluster.post(cluster.prefill_url + "/generate", pd, None))
        await wait_for_prefill_to_hold_blocks(cluster, idle)
        os.kill(worker, signal.SIGSTOP)
        try:
            status, data, _ = await cluster.post(cluster.decode_url + "/generate", dict(pd, routed_dp_rank=0), None)
            assert status == 503 and data["error"]["message"].startswith("lost connection to prefill 127.0.0.1:")
            # The stopped prefill is cut off (tcp), then the decode's quarantined blocks go back.
            assert await wait_gauges([cluster.decode], [idle[1]]) == [idle[1]]
        finally:
            os.kill(worker, signal.SIGCONT)
        # Resumed, the prefill finds its decode gone, either on the control stream or because the write
        # it posted first meets the connection the decode cut: its own request fails, nothing lands.
        status, data, _ = await asyncio.wait_for(prefill_leg, 15)
        assert status == 500, data
        assert data["error"]["message"].startswith(("lost decode decode-", "KV transfer failed: connection to peer 'decode-")), data
        assert await same_worker_outputs(cluster, PROMPTS, 200) == expected
        assert await wait_gauges([cluster.prefill, cluster.decode], idle) == idle
    finally:
        await cluster.close()


async def test_prefill_killed_mid_transfer_of_a_chunked_prompt():
    from dataclasses import replace

    from disagg.engine_config import SchedulerConfig
    from pd_cluster import TINY

    expected = await unified_outputs(PROMPTS)
    slow = replace(TINY, scheduler=SchedulerConfig(max_num_batched_tokens=2))  # ~110 chunks: a long transfer
    cluster = await start_pd("tcp", engine=slow, **FAST)
    try:
        idle = [[(w, 0) for w in side] for side in await cluster.free_blocks()]
        assert await same_worker_outputs(cluster, PROMPTS[:1], 100) == expected[:1]
        pd = cluster.pd_body(body(LONG * 2, 16), room=2 * 9)
        legs = asyncio.gather(cluster.post(cluster.prefill_url + "/generate", pd, None),
                              cluster.post(cluster.decode_url + "/generate", dict(pd, routed_dp_rank=0), None))
        await wait_for_prefill_to_hold_blocks(cluster, idle)
        os.kill(cluster.prefill.controller.workers[0].process.pid, signal.SIGKILL)
        (p_status, p_data, _), (d_status, d_data, _) = await asyncio.wait_for(legs, 10)
        assert p_status == 503 and p_data["error"]["message"].startswith("DP worker 0 died ("), p_data
        assert d_status == 503 and d_data["error"]["message"].startswith("lost connection to prefill 127.0.0.1:"), d_data
        assert await wait_gauges([cluster.decode], [idle[1]]) == [idle[1]]
        # The worker comes back under a new identity; the same worker pair serves exact outputs again.
        for _ in range(300):
            if cluster.prefill.controller.healthy():
                break
            await asyncio.sleep(0.1)
        assert await same_worker_outputs(cluster, PROMPTS, 300) == expected
        assert await wait_gauges([cluster.prefill, cluster.decode], idle) == idle
    finally:
        await cluster.close()
