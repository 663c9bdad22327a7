"""Prefill and decode servers whose DP worker is a tensor-parallel group, with the same or different
TP sizes on the two sides (the tiny model: 2 KV heads, one per rank at TP 2, each on two ranks at
TP 4): every answer equals the unified TP 1 server's token for token, in both flows and on both
backends; the KV that crosses is one copy of the prompt's blocks per copy the decode holds (each
decode rank gets its heads, from the prefill rank holding them; a replicated prefill head is read
once); the registry and the pull ticket carry the prefill's TP size; every block comes back. Every
layout runs with --kv-checksum (the digest reads blocks as a TP-1 cache holds them, so different TP
sizes digest alike), and a flipped byte is refused."""

import asyncio
import os
import random
import signal

import pytest
import pytest_asyncio

from pd_cluster import start_tp_pd, unified_answer

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]
GREEDY = {"temperature": 0, "ignore_eos": True, "max_tokens": 12}
BLOCK_BYTES = 2048  # one copy of a block: 2 layers x (K, V) x 4 tokens x 2 kv heads x 16 dims x 4 bytes
PULL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
        "remote_host": None, "remote_port": None}
LAYOUTS = [(2, 1, "tcp"), (2, 1, "nixl"), (1, 2, "tcp"), (1, 2, "nixl"), (2, 2, "tcp"), (2, 2, "nixl"),
           (4, 1, "tcp"), (1, 4, "nixl")]  # TP 4: each of the 2 KV heads on 2 ranks


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=LAYOUTS, ids=lambda p: f"p{p[0]}-d{p[1]}-{p[2]}")
async def cluster(request):
    prefill_tp, decode_tp, backend = request.param
    c = await start_tp_pd(backend, prefill_tp, decode_tp, disagg={"kv_checksum": True},
                          server={"enable_fault_injection": True})
    c.prefill_tp = prefill_tp
    c.copies = max(1, decode_tp // 2)  # of the KV each block needs: the decode's replicated heads each get theirs
    yield c
    await c.close()


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
    before = await cluster.decode_kv_bytes()
    got, ticket = await pd_completion(cluster, flow, prompt)
    assert got == text
    # push: all 11 blocks cross; pull: the 10 holding the first 40 tokens (the decode computes the last).
    # A head the prefill replicates is read from one rank only.
    assert await cluster.decode_kv_bytes() - before == (11 if flow == "push" else 10) * BLOCK_BYTES * cluster.copies
    if flow == "pull":
        assert ticket["tp_size"] == cluster.prefill_tp
    assert await cluster.settled(([96], [96])) == ([96], [96])


async def test_a_corrupted_transfer_between_tp_sizes_is_refused(cluster, unified):
    prompt = list(range(40, 61))  # 6 blocks
    text, _ = await unified_answer(cluster, unified, prompt)
    status, _, _ = await cluster.post(cluster.decode_url + "/faults", {"fault": "corrupt_transfers", "dp_rank": 0,
                                                                       "count": 1}, None)
    assert status == 200
    body = cluster.pd_body({"model": "tiny", "prompt": prompt, **GREEDY})
    (_, _, _), (status, data, _) = await cluster.post_both("/v1/completions", body, body)
    assert (status, data["error"]["code"]) == (503, "kv_checksum_mismatch") and "KV checksum mismatch" in \
        data["error"]["message"]
    assert (await pd_completion(cluster, "push", prompt))[0] == text
    assert await cluster.settled(([96], [96])) == ([96], [96])


async def test_the_registry_carries_the_prefill_tp_size(cluster):
    url = f"http://127.0.0.1:{cluster.prefill.bootstrap_port}/route"
    params = {"engine_rank": "-1", "target_dp_group": "-1", "target_pp_rank": "-1"}
    async with cluster.session.get(url, params=params) as r:
        assert r.status == 200
        topology = await r.json()
    assert (topology["tp_size"], topology["prefill_attn_tp_size"], topology["dp_size"]) == (cluster.prefill_tp,) * 2 + (1,)


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


async def restarted(server) -> None:
    for _ in range(300):
        worker = server.controller.workers[0]
        if worker.num_restarts == 1 and worker.available:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"worker restarts {worker.num_restarts}, available {worker.available}")


async def test_a_dead_rank_restarts_its_group_on_either_side(unified):
    """kill -9 of the decode's follower while a request decodes: that request gets the dead worker's
    503, the group restarts; then of the prefill's follower: its group restarts and registers again.
    After each, a P/D answer equals unified's and every block is free on both sides."""
    cluster = await start_tp_pd("tcp", 2, 2, server={"worker_restart_backoff_s": 0.1})
    try:
        rng = random.Random("kill")
        prompt = [rng.randrange(32, 127) for _ in range(41)]
        text, _ = await unified_answer(cluster, unified, prompt)
        body = cluster.pd_body({"model": "tiny", "prompt": prompt, "temperature": 0, "ignore_eos": True, "max_tokens": 300})
        running = asyncio.ensure_future(cluster.post_both("/v1/completions", body, body))
        for _ in range(200):  # the KV landed and the request decodes on the decode's group
            stats = await cluster.decode.controller.call_utility("stats")
            if stats[0].num_running == 1:
                break
            await asyncio.sleep(0.02)
        [follower] = children(cluster.decode.controller.workers[0].process.pid)
        os.kill(follower, signal.SIGKILL)
        (p_status, _, _), (status, data, _) = await running
        assert p_status == 200 and status == 503 and data["error"]["message"].startswith("DP worker 0 died ("), data
        await restarted(cluster.decode)
        assert (await pd_completion(cluster, "push", prompt))[0] == text
        assert await cluster.settled(([96], [96])) == ([96], [96])

        [follower] = children(cluster.prefill.controller.workers[0].process.pid)
        os.kill(follower, signal.SIGKILL)
        await restarted(cluster.prefill)
        assert (await pd_completion(cluster, "push", prompt))[0] == text
        assert (await pd_completion(cluster, "pull", prompt))[0] == text
        assert await cluster.settled(([96], [96])) == ([96], [96])
    finally:
        await cluster.close()
