"""`--kv-cache-dtype bfloat16` under a float32 model, across prefill and decode: the blocks move as
bfloat16 and the answer equals a unified server's with the same cache; a decode whose cache differs
from the prefill's is refused before any byte moves (503 incompatible_peer), and frees what it reserved."""

import asyncio
import re
from dataclasses import replace

import aiohttp
import pytest

from kernel_summary import HUGE_PAGES_CLAUSE, split_huge_pages
from pd_cluster import TINY, Cluster, pd_config, start_decode, start_pd, start_unified
from disagg.config import ServerConfig
from disagg.launch import start_server

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]
BF16_CACHE = replace(TINY, cache=replace(TINY.cache, kv_cache_dtype="bfloat16"))
LONG = "The quick brown fox jumps over the lazy dog, twice: " * 2  # > 100 tokens: chunked prefill
BODY = {"text": LONG, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}


async def generate(session: aiohttp.ClientSession, port: int, body: dict) -> tuple[int, dict]:
    async with session.post(f"http://127.0.0.1:{port}/generate", json=body) as resp:
        return resp.status, await resp.json()


async def test_bfloat16_blocks_move_and_decode_as_unified_does():
    cluster = await start_pd("tcp", engine=BF16_CACHE)
    unified = await start_unified(BF16_CACHE)
    try:
        status, want = await generate(cluster.session, unified.port, BODY)
        assert status == 200 and len(want["output_ids"]) == 12
        body = cluster.pd_body(BODY)
        (p_status, p_data, _), (d_status, d_data, _) = await cluster.post_both("/generate", body, body)
        assert (p_status, d_status) == (200, 200), (p_data, d_data)
        assert d_data["output_ids"] == want["output_ids"] and p_data["output_ids"] == want["output_ids"][:1]
        assert await cluster.free_blocks() == ([96, 96], [96, 96])
        for server in (cluster.prefill, cluster.decode, unified):
            engine, pages = split_huge_pages(server.controller.model.engine_summary)
            assert engine.endswith(", kv cache bfloat16 (set by --kv-cache-dtype)")
            assert re.fullmatch(HUGE_PAGES_CLAUSE, pages), pages
    finally:
        await asyncio.gather(cluster.close(), unified.close())


async def test_a_decode_whose_cache_dtype_differs_is_refused_and_frees_its_blocks():
    disagg = pd_config("tcp", bootstrap_timeout_s=3)  # how long the prefill waits for a decode that never comes
    prefill = await start_server(ServerConfig(port=0, dp_size=2, disaggregation_mode="prefill",
                                              load_balance_method="follow_bootstrap_room"), BF16_CACHE, disagg,
                                 lambda _: None)
    decode = await start_decode(disagg, TINY)  # float32 cache
    cluster = Cluster(prefill, decode, aiohttp.ClientSession())
    try:
        body = cluster.pd_body(BODY)
        (p_status, p_data, _), (d_status, d_data, _) = await cluster.post_both("/generate", body, body)
        assert (p_status, d_status, d_data["error"]["code"]) == (500, 503, "incompatible_peer"), (p_data, d_data)
        assert re.fullmatch(r"PeerRejected: prefill 127\.0\.0\.1:\d+ refused registration: "  # the rank's control port
                            "kv cache dtype mismatch: prefill dtype=bfloat16, decode dtype=float32",
                            d_data["error"]["message"]), d_data
        assert p_data["error"]["message"] == (
            f"no destination from decode for bootstrap_room {body['bootstrap_room']} within 3 s")
        assert await cluster.free_blocks() == ([96, 96], [96, 96])
    finally:
        await cluster.close()


@pytest.mark.parametrize("decode_engine, differs", [
    (TINY, "kv_cache_dtype 'bfloat16' on the prefill, 'float32' on the decode"),
    (replace(BF16_CACHE, model=replace(TINY.model, seed=1)), "weights '{p}' on the prefill, '{d}' on the decode"),
], ids=["kv_cache_dtype", "weights"])
async def test_behind_our_router_an_incompatible_pair_is_a_503_that_names_each_difference(decode_engine, differs):
    """Each server's /server_info has its compatibility record; our router compares them and answers
    503 incompatible_servers, naming every differing field, before any leg is sent (the decode's
    handshake would answer 500 on every request); /workers says why."""
    from disagg.router.config import PrefillEndpoint, RouterConfig
    from disagg.router.server import RouterServer

    disagg = pd_config("tcp")
    prefill = await start_server(ServerConfig(port=0, dp_size=1, disaggregation_mode="prefill"), BF16_CACHE, disagg,
                                 lambda _: None)
    decode = await start_decode(disagg, decode_engine, dp_size=1)
    prefill_url, decode_url = f"http://127.0.0.1:{prefill.port}", f"http://127.0.0.1:{decode.port}"
    router = RouterServer(RouterConfig(host="127.0.0.1", port=0, prefill=(PrefillEndpoint(prefill_url, prefill.bootstrap_port),),
                                       decode=(decode_url,)))
    await router.start()
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(decode_url + "/server_info") as r:
                record = (await r.json())["kv_compatibility"]
            async with session.get(prefill_url + "/server_info") as r:
                prefill_record = (await r.json())["kv_compatibility"]
            async with session.post(router.url + "/generate", json=BODY) as r:
                status, answer = r.status, await r.json()
            async with session.get(router.url + "/workers") as r:
                workers = await r.json()
        weights = {"p": prefill_record["weights"], "d": record["weights"]}
        assert (prefill_record["weights"] == record["weights"]) is ("weights" not in differs)
        assert record == {"model": "tiny", "weights": record["weights"], "dtype": "float32",
                          "kv_cache_dtype": decode.controller.model.compatibility["kv_cache_dtype"], "block_size": 4,
                          "num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "tp_size": 1, "transfer_backend": "tcp",
                          "kv_protocol": 1, "kv_checksum": False}
        assert re.fullmatch(r"[0-9a-f]{16}", record["weights"])
        message = f"prefill server {prefill_url} and decode server {decode_url} cannot pair: {differs.format(**weights)}"
        assert (status, answer["error"]["code"], answer["error"]["message"]) == (503, "incompatible_servers", message)
        assert workers["decode"][0]["incompatible_prefills"] == {prefill_url: differs.format(**weights)}
        assert await Cluster(prefill, decode, None).free_blocks() == ([96], [96])
    finally:
        await router.close()
        await asyncio.gather(prefill.close(), decode.close())
