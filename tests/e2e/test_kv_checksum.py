"""--kv-checksum: the prefill digests the blocks it writes, the decode digests what landed before the
first token. Intact KV answers as unified does; KV that landed with a byte flipped (the
corrupt_transfers fault) fails that request with 503 kv_checksum_mismatch, counted, its blocks freed
on both sides, and the next request is served again. Both transfer backends."""

import asyncio
import re

import aiohttp
import pytest

from pd_cluster import TINY, start_pd, start_unified

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]
LONG = "The quick brown fox jumps over the lazy dog, twice: " * 2  # > 100 tokens: several blocks, chunked
BODY = {"text": LONG, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}


async def metric(session: aiohttp.ClientSession, url: str, line_start: str) -> float:
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start))


@pytest.mark.parametrize("backend,piece_bytes", [("tcp", None), ("nixl", None), ("tcp", 1), ("nixl", 1)])
async def test_a_corrupted_transfer_is_refused_before_the_first_token(backend, piece_bytes):
    """piece_bytes 1: every block its own write, digested by the decode as it lands (the first
    corrupted before it is read); the default: the tiny model's prompt in one piece (tcp: 2 MiB
    pieces) or one write (nixl)."""
    cluster = await start_pd(backend, disagg={"kv_checksum": True, "kv_checksum_piece_bytes": piece_bytes},
                             server={"enable_fault_injection": True}, dp_size=1)
    unified = await start_unified(TINY)
    try:
        async with cluster.session.post(f"http://127.0.0.1:{unified.port}/generate", json=BODY) as r:
            want = (await r.json())["output_ids"]
        baseline = await cluster.free_blocks()
        body = cluster.pd_body(BODY)
        (p_status, _, _), (d_status, d_data, _) = await cluster.post_both("/generate", body, body)
        assert (p_status, d_status, d_data["output_ids"]) == (200, 200, want)
        async with cluster.session.post(cluster.decode_url + "/faults",
                                        json={"fault": "corrupt_transfers", "dp_rank": 0, "count": 1}) as r:
            assert r.status == 200
        body = cluster.pd_body(BODY)
        (p_status, _, _), (d_status, d_data, _) = await cluster.post_both("/generate", body, body)
        assert (p_status, d_status, d_data["error"]["code"]) == (200, 503, "kv_checksum_mismatch"), d_data
        assert re.fullmatch(rf"ChecksumMismatch: KV checksum mismatch for bootstrap_room {body['bootstrap_room']}: "
                            r"the prefill wrote [0-9a-f]{16}, the \d+ blocks that landed digest to [0-9a-f]{16}",
                            d_data["error"]["message"]), d_data
        assert await metric(cluster.session, cluster.decode_url, 'disagg_kv_transfer_failed_total{reason="checksum"}') == 1
        assert await metric(cluster.session, cluster.decode_url, "sglang:num_transfer_failed_reqs_total") == 1
        assert await cluster.free_blocks() == baseline
        body = cluster.pd_body(BODY)
        (_, _, _), (d_status, d_data, _) = await cluster.post_both("/generate", body, body)
        assert (d_status, d_data["output_ids"]) == (200, want)  # one corruption asked for, one request failed
    finally:
        await cluster.close()
        await unified.close()


@pytest.mark.parametrize("backend", ["tcp", "nixl"])
async def test_pull_flow_reads_are_checked_against_the_prefills_digest(backend):
    """vLLM's pull flow: the decode reads the leased blocks, asks for their digest with its release,
    and compares it with what it read; a read corrupted on purpose fails that request with 503, its
    blocks freed on both sides, and the next request is served."""
    cluster = await start_pd(backend, disagg={"kv_checksum": True}, server={"enable_fault_injection": True},
                             dp_size=1)
    unified = await start_unified(TINY)
    body = {"model": "tiny", "prompt": LONG, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    pull = {"do_remote_decode": True, "do_remote_prefill": False}

    async def pd(prompt: str = LONG) -> tuple[int, dict, str]:
        """A new prompt each time: a prompt the decode holds already is not read (nothing to check)."""
        status, prefill, _ = await cluster.post(cluster.prefill_url + "/v1/completions", dict(
            body, prompt=prompt, max_tokens=1, min_tokens=1, kv_transfer_params=pull), None)
        assert status == 200, prefill
        ticket = prefill["kv_transfer_params"]
        status, data, _ = await cluster.post(cluster.decode_url + "/v1/completions",
                                             dict(body, prompt=prompt, kv_transfer_params=ticket), None)
        return status, data, ticket["remote_request_id"]

    try:
        async with cluster.session.post(f"http://127.0.0.1:{unified.port}/v1/completions", json=body) as r:
            want = (await r.json())["choices"][0]["text"]
        baseline = await cluster.free_blocks()
        status, data, _ = await pd()
        assert (status, data["choices"][0]["text"]) == (200, want)
        async with cluster.session.post(cluster.decode_url + "/faults",
                                        json={"fault": "corrupt_transfers", "dp_rank": 0, "count": 1}) as r:
            assert r.status == 200
        status, data, rid = await pd("Another prompt, long enough to span several blocks of the KV cache. " * 2)
        assert (status, data["error"]["code"]) == (503, "kv_checksum_mismatch"), data
        assert re.fullmatch(rf"ChecksumMismatch: KV checksum mismatch for the KV of {rid}: the prefill wrote "
                            r"[0-9a-f]{16}, the \d+ blocks that landed digest to [0-9a-f]{16}", data["error"]["message"])
        assert await metric(cluster.session, cluster.decode_url, 'disagg_kv_transfer_failed_total{reason="checksum"}') == 1
        for _ in range(100):  # the prefill frees its blocks at the release
            if await cluster.free_blocks() == baseline:
                break
            await asyncio.sleep(0.05)
        assert await cluster.free_blocks() == baseline
        status, data, _ = await pd("A third prompt, which the decode has not seen either, spanning blocks. " * 2)
        assert status == 200 and len(data["choices"][0]["text"]) > 0  # one corruption asked for, one request failed
    finally:
        await cluster.close()
        await unified.close()


async def test_through_the_router_exactly_the_corrupted_requests_fail_and_a_thousand_intact_ones_pass():
    """The issue's count: corrupt_transfers 3, 12 requests through our router without retries: exactly 3
    answer 503 naming the checksum, 9 equal unified, the decode counts 3. With the router's default
    retries (2) a refused room is sent again on a fresh one: the first request meets all three
    corruptions and answers 503, the other 11 equal unified (3 more counted). Then 1,000 requests with
    no fault: every one 200, no transfer failed."""
    from disagg.router.config import PrefillEndpoint, RouterConfig
    from disagg.router.server import RouterServer

    cluster = await start_pd("tcp", disagg={"kv_checksum": True}, server={"enable_fault_injection": True}, dp_size=1)
    unified = await start_unified(TINY)
    routers = [RouterServer(RouterConfig(port=0, health_check_interval_s=0, retry_max_retries=retries,
                                         decode=(cluster.decode_url,),
                                         prefill=(PrefillEndpoint(cluster.prefill_url, cluster.prefill.bootstrap_port),)))
               for retries in (0, 2)]
    body = {"model": "tiny", "prompt": LONG, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    failed = 'disagg_kv_transfer_failed_total{reason="checksum"}'
    try:
        for router in routers:
            await router.start()
        async with cluster.session.post(f"http://127.0.0.1:{unified.port}/v1/completions", json=body) as r:
            want = (await r.json())["choices"][0]["text"]
        for router, counted in zip(routers, (3, 6)):
            async with cluster.session.post(cluster.decode_url + "/faults",
                                            json={"fault": "corrupt_transfers", "dp_rank": 0, "count": 3}) as r:
                assert r.status == 200
            answers = []
            for _ in range(12):  # one at a time: the next three rooms are the corrupted ones
                async with cluster.session.post(router.url + "/v1/completions", json=body) as r:
                    answers.append((r.status, await r.json()))
            ok = [a["choices"][0]["text"] for status, a in answers if status == 200]
            refused = [a["error"] for status, a in answers if status != 200]
            if router is routers[0]:
                assert (len(ok), [e["code"] for e in refused]) == (9, ["kv_checksum_mismatch"] * 3)
                assert all("KV checksum mismatch" in e["message"] for e in refused)
            else:
                # Sent again on a fresh room at most twice: the first request met all three corruptions.
                assert (len(ok), [e["code"] for e in refused]) == (11, ["kv_checksum_mismatch"])
                assert [status for status, _ in answers[:2]] == [503, 200]
            assert ok == [want] * len(ok)
            assert await metric(cluster.session, cluster.decode_url, failed) == counted

        short = {"model": "tiny", "max_tokens": 2, "temperature": 0, "ignore_eos": True}
        gate = asyncio.Semaphore(16)

        async def one(i: int) -> int:
            async with gate, cluster.session.post(routers[0].url + "/v1/completions",
                                                  json={**short, "prompt": f"request {i}"}) as r:
                await r.read()
                return r.status
        statuses = await asyncio.gather(*(one(i) for i in range(1000)))
        assert statuses == [200] * 1000
        assert await metric(cluster.session, cluster.decode_url, failed) == 6
        assert await metric(cluster.session, cluster.decode_url, "sglang:num_transfer_failed_reqs_total") == 6
    finally:
        for router in routers:
            await router.close()
        await cluster.close()
        await unified.close()
