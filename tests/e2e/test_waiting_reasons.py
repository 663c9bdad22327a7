"""vLLM's waiting requests by reason on a real decode: a request whose KV is on its way (the prefill's
write held back by the delay_transfers fault) waits "deferred" and counts in vllm:num_requests_waiting; once
its KV lands both are 0 again. SGLang's queue gauges say the same."""

import asyncio
import re

import aiohttp
import pytest

from pd_cluster import start_pd

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]
BODY = {"text": "Hi there, how are you?", "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}


async def waiting(session: aiohttp.ClientSession, url: str) -> tuple[float, float, float]:
    """(vllm:num_requests_waiting, its capacity part, its deferred part) of rank 0."""
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    def value(name: str, extra: str = "") -> float:
        match = re.search(rf'^{name}{{engine="0",model_name="tiny"{extra}}} (\S+)$', text, re.M)
        assert match, name + extra
        return float(match.group(1))
    return (value("vllm:num_requests_waiting"), value("vllm:num_requests_waiting_by_reason", ',reason="capacity"'),
            value("vllm:num_requests_waiting_by_reason", ',reason="deferred"'))


async def gauge(session: aiohttp.ClientSession, url: str, name: str) -> float:
    async with session.get(url + "/metrics") as r:
        return float(re.search(rf'^{name}{{[^}}]*dp_rank="0"[^}}]*}} (\S+)$', await r.text(), re.M).group(1))


async def test_a_request_waiting_for_its_kv_waits_deferred():
    cluster = await start_pd("tcp", server={"enable_fault_injection": True}, dp_size=1)
    try:
        assert await waiting(cluster.session, cluster.decode_url) == (0, 0, 0)
        async with cluster.session.post(cluster.prefill_url + "/faults",  # its write reports success 3 s late
                                        json={"fault": "delay_transfers", "dp_rank": 0, "count": 1, "seconds": 3}) as r:
            assert r.status == 200
        body = cluster.pd_body(BODY)
        both = asyncio.create_task(cluster.post_both("/generate", body, body))
        seen = set()
        for _ in range(100):
            seen.add(await waiting(cluster.session, cluster.decode_url))
            if (1, 0, 1) in seen or both.done():
                break
            await asyncio.sleep(0.02)
        assert (1, 0, 1) in seen, seen
        # SGLang's names for the same moment: the decode's transfer queue, the prefill's inflight one.
        assert await gauge(cluster.session, cluster.decode_url, "sglang:num_decode_transfer_queue_reqs") == 1
        assert await gauge(cluster.session, cluster.prefill_url, "sglang:num_prefill_inflight_queue_reqs") == 1
        assert await gauge(cluster.session, cluster.prefill_url, "sglang:num_prefill_bootstrap_queue_reqs") == 0
        (p_status, _, _), (d_status, d_data, _) = await both
        assert (p_status, d_status, len(d_data["output_ids"])) == (200, 200, 4)
        assert await waiting(cluster.session, cluster.decode_url) == (0, 0, 0)
    finally:
        await cluster.close()
