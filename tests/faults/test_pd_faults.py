"""Registry restart, a disconnect storm, two requests with one room: exact outcomes, and every
worker's free-block gauge back at its start."""

import asyncio
import random
import time
from dataclasses import replace

import pytest

from bootstrap.server import BootstrapServer
from disagg.pd_config import ControlConfig
from disagg.router.config import PrefillEndpoint, RouterConfig
from disagg.router.server import RouterServer
from pd_cluster import start_pd
from test_fencing import LONG, PROMPTS, body, unified_outputs, wait_gauges

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(180)]
FAST = {"registry_refresh_s": 0.3, "waiting_timeout_s": 10, "bootstrap_timeout_s": 10, "abort_ack_timeout_s": 2,
        "control": ControlConfig(heartbeat_interval_s=0.2, heartbeat_max_misses=3, connect_timeout_s=2)}


async def test_a_restarted_registry_learns_the_topology_again_from_the_prefill_ranks():
    expected = await unified_outputs(PROMPTS[:1])
    cluster = await start_pd("tcp", force_query=True, disagg=FAST)  # every decode asks the registry
    try:
        old = cluster.prefill.bootstrap
        port = old.port
        await old.close()
        fresh = BootstrapServer(old.config)
        await fresh.start(port=port)
        cluster.prefill.bootstrap = fresh  # closed with the cluster
        route = f"http://127.0.0.1:{port}/route?engine_rank=-1&target_dp_group=-1&target_pp_rank=-1"
        async with cluster.session.get(route) as r:
            assert r.status == 503  # it remembers nothing
        for _ in range(50):
            async with cluster.session.get(route) as r:
                if r.status == 200:
                    break
            await asyncio.sleep(0.1)
        assert (r.status, fresh.registry.num_registered) == (200, 2)
        pd = cluster.pd_body(body(PROMPTS[0]))
        (p, _, _), (d, data, _) = await cluster.post_both("/generate", pd, pd)
        assert (p, d, data["output_ids"]) == (200, 200, expected[0])
    finally:
        await cluster.close()


async def test_a_full_registry_fails_the_request_at_once_and_frees_every_block():
    """A prefill that registers its rooms (round_robin) with a registry whose room table is full: the
    request fails at once with the registry's 429 named, and the router cancels the decode leg that was
    waiting for the room."""
    expected = await unified_outputs(PROMPTS[:1])
    cluster = await start_pd("tcp", prefill_method="round_robin", disagg=FAST)
    try:
        start = await cluster.free_blocks()
        old = cluster.prefill.bootstrap
        await old.close()
        cluster.prefill.bootstrap = BootstrapServer(replace(old.config, max_rooms=1))  # closed with the cluster
        await cluster.prefill.bootstrap.start(port=old.port)
        for _ in range(50):  # the ranks register again within registry_refresh_s
            if cluster.prefill.bootstrap.registry.is_complete():
                break
            await asyncio.sleep(0.1)
        assert cluster.prefill.bootstrap.registry.is_complete()
        config = RouterConfig(host="127.0.0.1", port=0, health_check_interval_s=0, request_timeout_s=60,
                              retry_max_retries=0,  # the registry's answer as it is (a retry meets a full table too)
                              prefill=(PrefillEndpoint(cluster.prefill_url, old.port),), decode=(cluster.decode_url,))
        rooms = iter([10, 11])
        async with RouterServer(config, randbits=lambda bits: next(rooms)) as router:
            async with cluster.session.post(router.url + "/generate", json=body(PROMPTS[0])) as r:
                assert (r.status, (await r.json())["output_ids"]) == (200, expected[0])  # room 10: the table is full now
            started = time.monotonic()
            async with cluster.session.post(router.url + "/generate", json=body(PROMPTS[0])) as r:
                status, error = r.status, (await r.json())["error"]
            elapsed = time.monotonic() - started
        assert (status, error["message"]) == (503, (
            f"the bootstrap registry did not take bootstrap_room 11: BootstrapRejected: bootstrap server "
            f"127.0.0.1:{old.port} answered 429 to POST /register_dp_rank: the registry holds as many rooms as its "
            "--max-rooms allows"))
        assert elapsed < 2.0, elapsed  # not the decode's 10 s waiting deadline
        assert await cluster.settled(start) == start
    finally:
        await cluster.close()


async def test_a_disconnect_storm_leaves_no_block_behind():
    expected = await unified_outputs(PROMPTS)
    cluster = await start_pd("tcp", disagg=FAST)
    try:
        idle = [[(w, 0) for w in side] for side in await cluster.free_blocks()]
        rng = random.Random(8)

        async def leg(url, payload):
            async with cluster.session.post(url, json=payload) as r:
                async for _ in r.content:
                    pass

        tasks = []
        for i in range(24):
            pd = cluster.pd_body(dict(body(rng.choice(PROMPTS), 48), stream=True))
            legs = [cluster.prefill_url + "/generate", cluster.decode_url + "/generate"]
            rng.shuffle(legs)  # either side may lose its client first
            tasks += [asyncio.create_task(leg(url, pd)) for url in legs]
        await asyncio.sleep(0.02)
        for task in tasks:
            await asyncio.sleep(rng.uniform(0, 0.01))
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert await wait_gauges([cluster.prefill, cluster.decode], idle, timeout_s=15) == idle
        outs = []
        for text in PROMPTS:
            pd = cluster.pd_body(body(text))
            (p, _, _), (d, data, _) = await cluster.post_both("/generate", pd, pd)
            assert (p, d) == (200, 200), data
            outs.append(data["output_ids"])
        assert outs == expected
        assert await wait_gauges([cluster.prefill, cluster.decode], idle) == idle
    finally:
        await cluster.close()


async def test_two_requests_with_one_room_serve_one_and_refuse_the_other():
    expected = await unified_outputs([LONG])
    cluster = await start_pd("tcp", disagg=FAST)
    try:
        idle = [[(w, 0) for w in side] for side in await cluster.free_blocks()]
        pd = cluster.pd_body(body(LONG), room=2 * 31)  # both on prefill worker 0, decodes on workers 0 and 1
        results = await asyncio.gather(
            cluster.post(cluster.prefill_url + "/generate", pd, None),
            cluster.post(cluster.prefill_url + "/generate", pd, None),
            cluster.post(cluster.decode_url + "/generate", dict(pd, routed_dp_rank=0), None),
            cluster.post(cluster.decode_url + "/generate", dict(pd, routed_dp_rank=1), None),
        )
        prefills, decodes = sorted(results[:2], key=lambda r: r[0]), sorted(results[2:], key=lambda r: r[0])
        assert [p[0] for p in prefills] == [200, 400]
        assert prefills[1][1]["error"]["message"] == f"bootstrap_room {2 * 31} is already in use on this prefill worker"
        assert [d[0] for d in decodes] == [200, 500]
        assert decodes[0][1]["output_ids"] == expected[0]
        # The second decode's TransferInfo meets the room either still active or already served (a
        # loaded machine finishes the first pair before it arrives): refused at once either way.
        assert decodes[1][1]["error"]["message"] in (f"room {2 * 31} is already active with different transfer info",
                                                     f"bootstrap_room {2 * 31} was already served on this prefill worker")
        assert await wait_gauges([cluster.prefill, cluster.decode], idle) == idle
    finally:
        await cluster.close()


async def test_a_decode_for_a_room_already_served_is_refused_at_once():
    """Not after its bootstrap timeout ('no KV from prefill within 10 s'): the prefill worker remembers
    rooms whose KV went out; a new prefill request for the room serves it again."""
    expected = await unified_outputs([LONG])
    cluster = await start_pd("tcp", disagg=FAST)
    try:
        idle = [[(w, 0) for w in side] for side in await cluster.free_blocks()]
        pd = cluster.pd_body(body(LONG), room=2 * 31)
        (p, _, _), (d, data, _) = await cluster.post_both("/generate", pd, pd)
        assert (p, d, data["output_ids"]) == (200, 200, expected[0])
        status, data, _ = await cluster.post(cluster.decode_url + "/generate", pd, None)
        assert (status, data["error"]["message"]) == (500, f"bootstrap_room {2 * 31} was already served on this prefill worker")
        (p, _, _), (d, data, _) = await cluster.post_both("/generate", pd, pd)
        assert (p, d, data["output_ids"]) == (200, 200, expected[0])
        assert await wait_gauges([cluster.prefill, cluster.decode], idle) == idle
    finally:
        await cluster.close()


async def test_poison_requests_beside_innocent_ones_leave_the_innocents_exact():
    expected = await unified_outputs(PROMPTS)
    cluster = await start_pd("tcp", disagg=FAST)
    try:
        idle = [[(w, 0) for w in side] for side in await cluster.free_blocks()]
        poisons = [
            ({"input_ids": [5, 6, 7], "sampling_params": {"min_new_tokens": 2, "stop_token_ids": [999999999]}},
             "stop token id 999999999 is out of vocabulary (vocab_size=320)"),
            ({"text": "x", "sampling_params": {"sampling_seed": 2**70}}, None),
            ({"text": "x", "sampling_params": {"max_new_tokens": 2**62}}, None),
        ]

        async def innocent(text, room):
            pd = cluster.pd_body(body(text), room=room)
            (p, _, _), (d, data, _) = await cluster.post_both("/generate", pd, pd)
            assert (p, d) == (200, 200), data
            return data["output_ids"]

        async def poison(payload, room):
            pd = cluster.pd_body(payload, room=room)
            return await cluster.post_both("/generate", pd, pd)

        results = await asyncio.gather(*(innocent(t, 2 * (400 + i)) for i, t in enumerate(PROMPTS)),
                                       *(poison(p, 2 * (500 + i)) for i, (p, _) in enumerate(poisons)))
        assert list(results[:len(PROMPTS)]) == expected
        for ((p, p_data, _), (d, d_data, _)), (_, message) in zip(results[len(PROMPTS):], poisons):
            assert (p, d) == (400, 400), (p_data, d_data)
            if message is not None:
                assert p_data["error"]["message"] == d_data["error"]["message"] == message
        assert await wait_gauges([cluster.prefill, cluster.decode], idle) == idle
    finally:
        await cluster.close()
