"""External DP routing across prefill (dp 2) and decode (dp 2): body fields, the header, the
deprecated alias, the follow_bootstrap_room conflict (fails fast on both servers) and the
DISAGG_FORCE_QUERY_PREFILL_DP_RANK registry path."""

import asyncio
import itertools
import time

import aiohttp
import pytest
import pytest_asyncio

from disagg.router.config import PrefillEndpoint, RouterConfig
from disagg.router.server import RouterServer
from pd_cluster import start_pd, start_unified

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]
BODY = {"text": "route me", "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster():
    c = await start_pd("tcp")
    yield c
    await c.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def expected():
    u = await start_unified()
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{u.port}/generate", json=BODY) as r:
            ids = (await r.json())["output_ids"]
    await u.close()
    return ids


def room_with_parity(parity: int) -> int:
    return 2 * 12345 + parity


@pytest.mark.parametrize("p, d", list(itertools.product([0, 1], [0, 1])))
async def test_every_rank_pair_through_body_fields(cluster, expected, p, d):
    room = room_with_parity(1 - p)  # the pinned prefill rank is never room % dp_size
    pd = cluster.pd_body(BODY, room)
    (ps, pdata, ph), (ds, ddata, dh) = await cluster.post_both(
        "/generate", dict(pd, routed_dp_rank=p, disagg_prefill_dp_rank=p), dict(pd, routed_dp_rank=d, disagg_prefill_dp_rank=p))
    assert (ps, ds) == (200, 200), (pdata, ddata)
    assert (pdata["meta_info"]["dp_rank"], ddata["meta_info"]["dp_rank"]) == (p, d)
    assert (ph["X-data-parallel-rank"], dh["X-data-parallel-rank"]) == (str(p), str(d))
    assert ddata["output_ids"] == expected


@pytest.mark.parametrize("p, d", list(itertools.product([0, 1], [0, 1])))
async def test_every_rank_pair_through_the_header_which_wins_over_the_body(cluster, expected, p, d):
    pd = cluster.pd_body(dict(BODY, routed_dp_rank=1 - d), room_with_parity(p))  # fast path finds rank p
    headers = ({"x-data-parallel-rank": str(p)}, {"X-Data-Parallel-Rank": str(d)})
    (ps, pdata, _), (ds, ddata, _) = await cluster.post_both("/generate", dict(pd, routed_dp_rank=1 - p), pd, headers)
    assert (ps, ds) == (200, 200), (pdata, ddata)
    assert (pdata["meta_info"]["dp_rank"], ddata["meta_info"]["dp_rank"]) == (p, d)
    assert ddata["output_ids"] == expected


@pytest.mark.parametrize("p, d", list(itertools.product([0, 1], [0, 1])))
async def test_every_rank_pair_through_the_deprecated_alias(cluster, expected, p, d):
    pd = cluster.pd_body(BODY, room_with_parity(1 - p))
    (ps, pdata, _), (ds, ddata, _) = await cluster.post_both(
        "/generate", dict(pd, data_parallel_rank=p, disagg_prefill_dp_rank=p), dict(pd, data_parallel_rank=d, disagg_prefill_dp_rank=p))
    assert (ps, ds) == (200, 200)
    assert (pdata["meta_info"]["dp_rank"], ddata["meta_info"]["dp_rank"]) == (p, d)
    assert ddata["output_ids"] == expected


async def test_conflict_fails_fast_on_both_servers_with_the_message(cluster):
    room = room_with_parity(0)
    pd = cluster.pd_body(BODY, room)
    start = time.monotonic()
    (ps, pdata, _), (ds, ddata, _) = await cluster.post_both("/generate", dict(pd, routed_dp_rank=1), pd)
    elapsed = time.monotonic() - start
    message = (
        f"bootstrap_room {room} was dispatched to prefill DP rank 1, but load_balance_method follow_bootstrap_room "
        "implies rank 0 (room % dp_size=2), where the decode looks for its KV; set DISAGG_FORCE_QUERY_PREFILL_DP_RANK=1 "
        "on the prefill and decode servers to resolve the rank through the bootstrap registry, or send disagg_prefill_dp_rank=1"
    )
    assert (ps, pdata["error"]["message"]) == (400, message)
    assert ds == 500 and ddata["error"]["message"] == message
    assert elapsed < 5  # nothing waited for a timeout (30 s here)
    assert await cluster.free_blocks() == ([96, 96], [96, 96])


@pytest.mark.parametrize("p", [0, 1])
async def test_a_decode_told_the_wrong_prefill_rank_fails_fast_on_both_servers(cluster, expected, p):
    # sgl-model-gateway's shapes: routed_dp_rank on the prefill leg, disagg_prefill_dp_rank on the decode's,
    # here naming the other rank. The rank asked answers the decode at once; the front fails the room on p.
    # room_with_parity(0) is the room the conflict test failed on every rank: a new dispatch supersedes that.
    pd = cluster.pd_body(BODY, room_with_parity(p))
    start = time.monotonic()
    (ps, pdata, _), (ds, ddata, _) = await cluster.post_both(
        "/generate", dict(pd, routed_dp_rank=p), dict(pd, routed_dp_rank=0, disagg_prefill_dp_rank=1 - p))
    elapsed = time.monotonic() - start
    message = (f"bootstrap_room {pd['bootstrap_room']} was dispatched to prefill DP rank {p}, but the decode asked "
               f"prefill DP rank {1 - p} for its KV: disagg_prefill_dp_rank must name the rank the prefill request went to")
    assert (ps, pdata["error"]["message"]) == (500, message)
    assert (ds, ddata["error"]["message"]) == (500, message)
    assert elapsed < 5  # the bootstrap deadline is 30 s here
    assert await cluster.free_blocks() == ([96, 96], [96, 96])
    (ps, _, _), (ds, ddata, _) = await cluster.post_both(  # the same room, routed right: served
        "/generate", dict(pd, routed_dp_rank=p), dict(pd, routed_dp_rank=0, disagg_prefill_dp_rank=p))
    assert (ps, ds, ddata["output_ids"]) == (200, 200, expected)


@pytest.mark.parametrize("p", [0, 1])
async def test_a_stray_duplicate_decode_at_the_wrong_rank_leaves_the_room_to_its_own_decode(cluster, expected, p):
    """The room's decode asks rank p, a duplicate decode for the same room asks the other rank; both wait
    there before the prefill request comes. The duplicate is answered at once as misrouted; the room
    keeps its own decode's destination, and that pair is served."""
    pd = cluster.pd_body(BODY, 2 * 23456 + p)
    own = asyncio.create_task(cluster.post(cluster.decode_url + "/generate", dict(pd, routed_dp_rank=0, disagg_prefill_dp_rank=p), None))
    stray = asyncio.create_task(cluster.post(cluster.decode_url + "/generate", dict(pd, routed_dp_rank=1, disagg_prefill_dp_rank=1 - p), None))
    await asyncio.sleep(1.0)  # both destinations reach their prefill ranks first
    start = time.monotonic()
    ps, pdata, _ = await cluster.post(cluster.prefill_url + "/generate", dict(pd, routed_dp_rank=p), None)
    (ds, ddata, _), (ss, sdata, _) = await asyncio.gather(own, stray)
    assert (ps, ds, ddata["output_ids"]) == (200, 200, expected), (pdata, ddata)
    assert (ss, sdata["error"]["message"]) == (500, (
        f"bootstrap_room {pd['bootstrap_room']} was dispatched to prefill DP rank {p}, but the decode asked prefill DP "
        f"rank {1 - p} for its KV: disagg_prefill_dp_rank must name the rank the prefill request went to"))
    assert time.monotonic() - start < 5  # nobody waited for a deadline (30 s here)
    assert await cluster.free_blocks() == ([96, 96], [96, 96])


async def test_flag_resolves_the_rank_through_the_registry(expected):
    forced = await start_pd("tcp", force_query=True)
    try:
        for p, d in itertools.product([0, 1], [0, 1]):
            pd = forced.pd_body(BODY, room_with_parity(1 - p))
            (ps, pdata, _), (ds, ddata, _) = await forced.post_both("/generate", dict(pd, routed_dp_rank=p), dict(pd, routed_dp_rank=d))
            assert (ps, ds) == (200, 200), (pdata, ddata)
            assert (pdata["meta_info"]["dp_rank"], ddata["meta_info"]["dp_rank"], ddata["output_ids"]) == (p, d, expected)
    finally:
        await forced.close()


async def test_round_robin_prefill_registers_rooms_and_decode_queries(expected):
    rr = await start_pd("tcp", prefill_method="round_robin")
    try:
        for _ in range(4):
            pd = rr.pd_body(BODY)
            (ps, _, _), (ds, ddata, _) = await rr.post_both("/generate", pd, pd)
            assert (ps, ds, ddata["output_ids"]) == (200, 200, expected)
    finally:
        await rr.close()


async def test_router_external_dp_routing_mode_sees_no_mismatch(cluster, expected):
    config = RouterConfig(port=0, prefill=(PrefillEndpoint(cluster.prefill_url, cluster.prefill.bootstrap_port),),
                          decode=(cluster.decode_url,), test_external_dp_routing=True, health_check_interval_s=0)
    async with RouterServer(config) as router, aiohttp.ClientSession() as s:
        for _ in range(8):
            async with s.post(router.url + "/generate", json=BODY) as r:
                data = await r.json()
                assert r.status == 200, data
                assert data["output_ids"] == expected
