"""Prefill and decode servers whose DP worker is a tensor-parallel group, with the same or different
TP sizes on the two sides (the tiny model: 2 KV heads, one per rank at TP 2): every answer equals the
unified TP 1 server's token for token, in both flows and on both backends; the KV that crosses is
one copy of the prompt's blocks (each decode rank gets its heads, from the prefill rank holding
them); the registry and the pull ticket carry the prefill's TP size; every block comes back."""

import asyncio
import random
from dataclasses import replace

import aiohttp
import pytest
import pytest_asyncio

from disagg.config import ServerConfig
from disagg.launch import start_server
from pd_cluster import TINY, Cluster, pd_config, start_decode, unified_answer

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]
GREEDY = {"temperature": 0, "ignore_eos": True, "max_tokens": 12}
BLOCK_BYTES = 2048  # one copy of a block: 2 layers x (K, V) x 4 tokens x 2 kv heads x 16 dims x 4 bytes
PULL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
        "remote_host": None, "remote_port": None}
LAYOUTS = [(2, 1, "tcp"), (2, 1, "nixl"), (1, 2, "tcp"), (1, 2, "nixl"), (2, 2, "tcp"), (2, 2, "nixl")]


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=LAYOUTS, ids=lambda p: f"p{p[0]}-d{p[1]}-{p[2]}")
async def cluster(request):
    prefill_tp, decode_tp, backend = request.param
    disagg = pd_config(backend)
    prefill, decode = await asyncio.gather(
        start_server(ServerConfig(port=0, dp_size=1, disaggregation_mode="prefill"),
                     replace(TINY, tensor_parallel_size=prefill_tp), disagg, lambda _: None),
        start_decode(disagg, replace(TINY, tensor_parallel_size=decode_tp), dp_size=1),
    )
    c = Cluster(prefill, decode, aiohttp.ClientSession())
    c.prefill_tp = prefill_tp
    yield c
    await c.close()


async def decode_kv_bytes(cluster) -> float:
    async with cluster.session.get(cluster.decode_url + "/metrics") as r:
        lines = (await r.text()).splitlines()
    return next((float(line.split()[1]) for line in lines if line.startswith("disagg_kv_transfer_bytes_total ")), 0.0)


async def pd_completion(cluster, flow: str, prompt: list[int]) -> tuple[str, dict]:
    body = {"model": "tiny", "prompt": prompt, **GREEDY}
    if flow == "push":
        pd = cluster.pd_body(body)
        (p_status, _, _), (status, data, _) = await cluster.post_both("/v1/completions", pd, pd)
        assert p_status == 200
        ticket = {}
    else:
        status, data, _ = await cluster.post(cluster.prefill_url + "/v1/completions",
                                             dict(body, max_tokens=1, min_tokens=1, kv_transfer_params=PULL), None)
        assert status == 200, data
        ticket = data["kv_transfer_params"]
        status, data, _ = await cluster.post(cluster.decode_url + "/v1/completions",
                                             dict(body, kv_transfer_params=ticket), None)
    assert status == 200, data
    return data["choices"][0]["text"], ticket


@pytest.mark.parametrize("flow", ["push", "pull"])
async def test_answers_equal_unified_and_one_copy_of_the_kv_crosses(cluster, unified, flow):
    rng = random.Random(f"{flow}-tp")
    prompt = [rng.randrange(32, 127) for _ in range(41)]  # 11 blocks of 4; chunked prefill (16 a step)
    text, _ = await unified_answer(cluster, unified, prompt)
    before = await decode_kv_bytes(cluster)
    got, ticket = await pd_completion(cluster, flow, prompt)
    assert got == text
    # push: all 11 blocks cross; pull: the 10 holding the first 40 tokens (the decode computes the last)
    assert await decode_kv_bytes(cluster) - before == (11 if flow == "push" else 10) * BLOCK_BYTES
    if flow == "pull":
        assert ticket["tp_size"] == cluster.prefill_tp
    assert await cluster.settled(([96], [96])) == ([96], [96])


async def test_the_registry_carries_the_prefill_tp_size(cluster):
    url = f"http://127.0.0.1:{cluster.prefill.bootstrap_port}/route"
    params = {"engine_rank": "-1", "target_dp_group": "-1", "target_pp_rank": "-1"}
    async with cluster.session.get(url, params=params) as r:
        assert r.status == 200
        topology = await r.json()
    assert (topology["tp_size"], topology["prefill_attn_tp_size"], topology["dp_size"]) == (cluster.prefill_tp,) * 2 + (1,)
