"""SGLang's and vLLM's P/D metric names on real prefill and decode servers, both transfer backends:
a moved request is one observation of the transfer histograms on the side that moved the KV (the
prefill that wrote it, push flow; the decode that read it, pull flow) with its exact byte count; a
request whose prefill never hears from its decode counts as a bootstrap failure there, one whose
transfer failed as a transfer failure on the decode; the queues are back to 0."""

import re

import aiohttp
import pytest

from pd_cluster import start_pd

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]
LONG = "The quick brown fox jumps over the lazy dog, twice: " * 2
BODY = {"text": LONG, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
PULL = {"do_remote_decode": True, "do_remote_prefill": False}
QUEUES = ("prefill_bootstrap", "prefill_inflight", "decode_prealloc", "decode_transfer")


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Every sample of rank 0 by name (labels dropped)."""
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    samples = {}
    for name, labels, value in re.findall(r"^((?:sglang|vllm):[a-z_]+)\{([^}]*)\} (\S+)$", text, re.M):
        if 'dp_rank="0"' in labels or 'engine="0"' in labels:
            if "le=" not in labels:
                samples[name] = float(value)
    return samples


@pytest.mark.parametrize("backend", ["tcp", "nixl"])
async def test_push_transfers_are_observed_on_the_prefill_and_failures_counted(backend):
    cluster = await start_pd(backend, server={"enable_fault_injection": True}, disagg={"bootstrap_timeout_s": 1},
                             dp_size=1)
    try:
        body = cluster.pd_body(BODY)
        (p_status, p_data, _), (d_status, d_data, _) = await cluster.post_both("/generate", body, body)
        assert (p_status, d_status) == (200, 200)
        prefill = await scrape(cluster.session, cluster.prefill_url)
        decode = await scrape(cluster.session, cluster.decode_url)
        assert "vllm:nixl_bytes_transferred_sum" not in decode  # the decode did not move it: no series
        assert (prefill["sglang:kv_transfer_latency_ms_count"], prefill["vllm:nixl_xfer_time_seconds_count"]) == (1, 1)
        assert prefill["vllm:nixl_bytes_transferred_sum"] == await kv_bytes(cluster.session, cluster.prefill_url)
        for side, name in ((prefill, "prefill"), (decode, "decode")):
            assert [side[f"sglang:num_{q}_queue_reqs"] for q in QUEUES] == [0, 0, 0, 0], name
            assert (side["sglang:num_bootstrap_failed_reqs_total"], side["sglang:num_transfer_failed_reqs_total"]) == (0, 0)
        # The prefill alone: no decode ever names a destination for this room (bootstrap_timeout_s 1).
        body = cluster.pd_body(BODY)
        status, data, _ = await cluster.post(cluster.prefill_url + "/generate", body, None)
        assert (status, data["error"]["message"]) == (
            500, f"no destination from decode for bootstrap_room {body['bootstrap_room']} within 1 s")
        prefill = await scrape(cluster.session, cluster.prefill_url)
        assert (prefill["sglang:num_bootstrap_failed_reqs_total"], prefill["sglang:num_transfer_failed_reqs_total"]) == (1, 0)
        # A transfer that fails: the prefill's write reports FAILED; the decode hears FAILED.
        async with cluster.session.post(cluster.prefill_url + "/faults",
                                        json={"fault": "fail_transfers", "dp_rank": 0, "count": 1}) as r:
            assert r.status == 200
        body = cluster.pd_body(BODY)
        (p_status, _, _), (d_status, d_data, _) = await cluster.post_both("/generate", body, body)
        assert (p_status, d_status) == (500, 500), d_data
        prefill = await scrape(cluster.session, cluster.prefill_url)
        decode = await scrape(cluster.session, cluster.decode_url)
        assert (prefill["sglang:num_bootstrap_failed_reqs_total"], prefill["sglang:num_transfer_failed_reqs_total"]) == (1, 1)
        assert (decode["sglang:num_transfer_failed_reqs_total"], decode["vllm:nixl_num_failed_transfers_total"]) == (1, 1)
        assert [decode[f"sglang:num_{q}_queue_reqs"] for q in QUEUES] == [0, 0, 0, 0]
        async with cluster.session.get(cluster.decode_url + "/server_info") as r:
            pd = (await r.json())["internal_states"][0]["pd"]
        assert pd == {"prefill_bootstrap": 0, "prefill_inflight": 0, "decode_prealloc": 0, "decode_transfer": 0,
                      "num_bootstrap_failed": 0, "num_transfer_failed": 1}
    finally:
        await cluster.close()


async def kv_bytes(session: aiohttp.ClientSession, url: str) -> float:
    async with session.get(url + "/metrics") as r:
        return float(re.search(r"^disagg_kv_transfer_bytes_total (\S+)$", await r.text(), re.M).group(1))


async def test_a_pull_read_is_observed_on_the_decode():
    cluster = await start_pd("tcp", dp_size=1)
    try:
        body = {"model": "tiny", "prompt": LONG, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        status, data, _ = await cluster.post(cluster.prefill_url + "/v1/completions",
                                             dict(body, max_tokens=1, min_tokens=1, kv_transfer_params=PULL), None)
        assert status == 200, data
        status, data, _ = await cluster.post(cluster.decode_url + "/v1/completions",
                                             dict(body, kv_transfer_params=data["kv_transfer_params"]), None)
        assert status == 200, data
        decode = await scrape(cluster.session, cluster.decode_url)
        assert (decode["sglang:kv_transfer_speed_gb_s_count"], decode["vllm:nixl_xfer_time_seconds_count"]) == (1, 1)
        assert decode["vllm:nixl_bytes_transferred_sum"] == await kv_bytes(cluster.session, cluster.decode_url) > 0
        assert "vllm:nixl_xfer_time_seconds_count" not in await scrape(cluster.session, cluster.prefill_url)
    finally:
        await cluster.close()
