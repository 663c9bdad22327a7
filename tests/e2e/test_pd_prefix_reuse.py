"""Decode-side prefix reuse end to end: a later turn of a conversation moves only the KV after what
the decode already holds (its own prefix cache), in both flows and on both backends, and its answer
equals the unified server's token for token."""

import random

import pytest
import pytest_asyncio

from pd_cluster import start_pd, unified_answer

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]
GREEDY = {"temperature": 0, "ignore_eos": True, "max_tokens": 12}
BLOCK_BYTES = 2048  # 2 layers x (K, V) x 4 tokens x 2 kv heads x 16 dims x 4 bytes
PULL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
        "remote_host": None, "remote_port": None}


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["tcp", "nixl"])
async def cluster(request):
    c = await start_pd(request.param)
    yield c
    await c.close()


async def pd_completion(cluster, flow: str, prompt: list[int]) -> str:
    """One request through P/D, its decode pinned to DP rank 0 (a router keeps a conversation there)."""
    body = {"model": "tiny", "prompt": prompt, **GREEDY}
    if flow == "push":
        pd = cluster.pd_body(body)
        (p_status, _, _), (status, data, _) = await cluster.post_both("/v1/completions", pd, dict(pd, routed_dp_rank=0))
        assert p_status == 200
    else:
        status, data, _ = await cluster.post(cluster.prefill_url + "/v1/completions",
                                             dict(body, max_tokens=1, min_tokens=1, kv_transfer_params=PULL), None)
        assert status == 200, data
        status, data, _ = await cluster.post(cluster.decode_url + "/v1/completions",
                                             dict(body, kv_transfer_params=data["kv_transfer_params"], routed_dp_rank=0), None)
    assert status == 200, data
    return data["choices"][0]["text"]


@pytest.mark.parametrize("flow", ["push", "pull"])
async def test_a_later_turn_moves_only_its_new_blocks(cluster, unified, flow):
    rng = random.Random(f"{flow}")
    first = [rng.randrange(32, 127) for _ in range(41)]  # a prompt no worker has seen
    first_text, first_ids = await unified_answer(cluster, unified, first)
    before = await cluster.decode_kv_bytes()
    assert await pd_completion(cluster, flow, first) == first_text
    # 41 prompt tokens in 11 blocks: all of them cross (push), or the 10 holding the first 40 (pull).
    first_blocks = 11 if flow == "push" else 10
    assert await cluster.decode_kv_bytes() - before == first_blocks * BLOCK_BYTES

    second = first + first_ids + [rng.randrange(32, 127) for _ in range(10)]  # 63 tokens
    second_text, _ = await unified_answer(cluster, unified, second)
    before = await cluster.decode_kv_bytes()
    assert await pd_completion(cluster, flow, second) == second_text
    # The decode computed 52 of the first turn's 53 tokens (not the last answer token): 13 full blocks
    # are its own. Only blocks 13-15 cross: the 11 new tokens' KV (push: the 63 prompt tokens; pull:
    # the 62 before the one it computes itself), not the 16 blocks of the whole history.
    assert await cluster.decode_kv_bytes() - before == 3 * BLOCK_BYTES
    assert await cluster.settled(([96, 96], [96, 96])) == ([96, 96], [96, 96])
