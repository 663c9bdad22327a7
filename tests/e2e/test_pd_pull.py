"""Pull flow (vLLM's kv_transfer_params) end to end: the prefill answers with a ticket and leases
its blocks; the decode reads them and releases the lease; outputs equal unified; every failure
frees both sides."""

import asyncio

import pytest
import pytest_asyncio

from pd_cluster import start_pd

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]
GREEDY = {"temperature": 0, "ignore_eos": True}
LONG = "The quick brown fox jumps over the lazy dog, twice: " * 2
PULL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
        "remote_host": None, "remote_port": None}


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["tcp", "nixl"])
async def cluster(request):
    c = await start_pd(request.param, disagg={"kv_lease_s": 2.0})
    yield c
    await c.close()


async def idle(cluster):
    for _ in range(100):
        stats = [await s.controller.call_utility("stats") for s in (cluster.prefill, cluster.decode)]
        if all(w.num_free_blocks == w.num_total_blocks for side in stats for w in side):
            return True
        await asyncio.sleep(0.05)
    return False


async def prefill_leg(cluster, body):
    # What vLLM's router sends the prefill: one token, min_tokens 1, do_remote_decode.
    status, data, _ = await cluster.post(cluster.prefill_url + "/v1/completions",
                                         dict(body, max_tokens=1, min_tokens=1, kv_transfer_params=PULL), None)
    assert status == 200, data
    return data


@pytest.mark.parametrize("prompt", ["hi", LONG], ids=["short", "long"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_pull_flow_equals_unified(cluster, unified, prompt, stream):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, **GREEDY}
    async with cluster.session.post(f"http://127.0.0.1:{unified.port}/v1/completions", json=body) as r:
        expected = (await r.json())["choices"][0]["text"]
    ticket = (await prefill_leg(cluster, body))["kv_transfer_params"]
    assert (ticket["do_remote_prefill"], ticket["remote_engine_id"].startswith("prefill-"), ticket["tp_size"]) == (True, True, 1)
    assert ticket["remote_request_id"].startswith("cmpl-") and ticket["remote_host"] == "127.0.0.1"
    status, data, _ = await cluster.post(cluster.decode_url + "/v1/completions",
                                         dict(body, kv_transfer_params=ticket, stream=stream), None)
    assert status == 200, data
    if stream:
        import json
        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in data.splitlines()
                       if line.startswith("data: {") and json.loads(line[6:])["choices"])
    else:
        text = data["choices"][0]["text"]
    assert text == expected
    assert await idle(cluster)


async def test_an_unclaimed_lease_expires_and_frees_the_prefill(cluster):
    await prefill_leg(cluster, {"model": "tiny", "prompt": LONG, "max_tokens": 4, **GREEDY})
    stats = await cluster.prefill.controller.call_utility("stats")
    assert any(w.num_free_blocks < w.num_total_blocks for w in stats)  # leased
    assert await idle(cluster)  # kv_lease_s=2: expired


async def test_a_ticket_for_released_blocks_or_an_unknown_engine_fails_cleanly(cluster):
    body = {"model": "tiny", "prompt": LONG, "max_tokens": 4, **GREEDY}
    ticket = (await prefill_leg(cluster, body))["kv_transfer_params"]
    ok, data, _ = await cluster.post(cluster.decode_url + "/v1/completions", dict(body, kv_transfer_params=ticket), None)
    assert ok == 200, data
    status, data, _ = await cluster.post(cluster.decode_url + "/v1/completions", dict(body, kv_transfer_params=ticket), None)
    assert status == 500
    assert data["error"]["message"] == (
        f"TransferFailed: prefill 127.0.0.1:{ticket['remote_port']} refused the claim of {ticket['remote_request_id']}: "
        f"no blocks are leased for {ticket['remote_request_id']} (expired, released or never granted)")
    forged = dict(ticket, remote_engine_id="prefill-00000000-dp9")
    status, data, _ = await cluster.post(cluster.decode_url + "/v1/completions", dict(body, kv_transfer_params=forged), None)
    assert (status, data["error"]["param"]) == (400, "kv_transfer_params")
    assert data["error"]["message"].startswith("the ticket names prefill engine 'prefill-00000000-dp9', but 127.0.0.1:")
    missing = {"do_remote_prefill": True, "remote_host": "127.0.0.1"}
    status, data, _ = await cluster.post(cluster.decode_url + "/v1/completions", dict(body, kv_transfer_params=missing), None)
    assert (status, data["error"]["message"], data["error"]["param"]) == (400, (
        "kv_transfer_params with do_remote_prefill needs remote_block_ids, remote_engine_id, remote_port, "
        "remote_request_id as the prefill returned them"), "kv_transfer_params")
    assert await idle(cluster)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_our_router_in_pull_mode_equals_unified(cluster, unified, stream):
    import json

    from disagg.router.config import PrefillEndpoint, RouterConfig
    from disagg.router.server import RouterServer

    router = RouterServer(RouterConfig(port=0, protocol="pull", health_check_interval_s=0,
                                       prefill=(PrefillEndpoint(cluster.prefill_url, None),), decode=(cluster.decode_url,)))
    await router.start()
    try:
        body = {"model": "tiny", "messages": [{"role": "user", "content": LONG}], "max_tokens": 12, **GREEDY}
        async with cluster.session.post(f"http://127.0.0.1:{unified.port}/v1/chat/completions", json=body) as r:
            expected = (await r.json())["choices"][0]["message"]["content"]
        async with cluster.session.post(router.url + "/v1/chat/completions", json=dict(body, stream=stream)) as r:
            assert r.status == 200, await r.text()
            if stream:
                text = "".join((c.get("delta") or {}).get("content") or "" for line in (await r.text()).splitlines()
                               if line.startswith("data: {") for c in json.loads(line[6:])["choices"])
            else:
                text = (await r.json())["choices"][0]["message"]["content"]
        assert text == expected
        assert await idle(cluster)
    finally:
        await router.close()


async def fill_decode_rank0(cluster, request_id: str) -> asyncio.Task:
    """A push request on decode DP worker 0 whose prefill never comes: it holds 85 of the worker's 96
    blocks (340 prompt tokens) until it is aborted."""
    body = cluster.pd_body({"model": "tiny", "prompt": [7] * 340, "max_tokens": 2, "routed_dp_rank": 0,
                            "request_id": request_id, **GREEDY})
    filler = asyncio.create_task(cluster.post(cluster.decode_url + "/v1/completions", body, None))
    for _ in range(200):
        [free, _] = [w.num_free_blocks for w in await cluster.decode.controller.call_utility("stats")]
        if free == 96 - 85:
            return filler
        await asyncio.sleep(0.02)
    raise AssertionError(f"the filler did not reserve its blocks: {free} free")


async def abort(cluster, filler: asyncio.Task, request_id: str) -> None:
    status, data, _ = await cluster.post(cluster.decode_url + "/abort_request", {"rid": request_id}, None)
    assert status == 200, data
    status, data, _ = await filler
    assert (status, data["choices"][0]["finish_reason"], data["usage"]["completion_tokens"]) == (200, "abort", 0), data


async def test_a_claim_holds_the_lease_while_the_request_waits_for_room(cluster, unified):
    """The lease is 2 s. A pull request waits 3 s for room in the decode's KV cache; the claim it
    sent on arrival keeps the prefill's blocks for it, so it completes equal to unified."""
    filler = await fill_decode_rank0(cluster, "filler-wait")
    body = {"model": "tiny", "prompt": LONG, "max_tokens": 12, **GREEDY}
    async with cluster.session.post(f"http://127.0.0.1:{unified.port}/v1/completions", json=body) as r:
        expected = (await r.json())["choices"][0]["text"]
    ticket = (await prefill_leg(cluster, body))["kv_transfer_params"]
    decode = asyncio.create_task(cluster.post(cluster.decode_url + "/v1/completions",
                                              dict(body, kv_transfer_params=ticket, routed_dp_rank=0), None))
    await asyncio.sleep(3.0)
    assert not decode.done()
    assert [w.num_leases for w in await cluster.prefill.controller.call_utility("stats")].count(1) == 1  # still held
    await abort(cluster, filler, "filler-wait")
    status, data, _ = await decode
    assert (status, data["choices"][0]["text"]) == (200, expected)
    assert await idle(cluster)


async def test_a_request_aborted_while_it_waits_for_room_releases_its_lease_at_once(cluster):
    """Released on abort, not at the lease's expiry (2 s after the ticket was granted)."""
    filler = await fill_decode_rank0(cluster, "filler-abort")
    body = {"model": "tiny", "prompt": LONG, "max_tokens": 12, "request_id": "queued-pull", **GREEDY}
    ticket = (await prefill_leg(cluster, body))["kv_transfer_params"]
    granted = asyncio.get_running_loop().time()
    decode = asyncio.create_task(cluster.post(cluster.decode_url + "/v1/completions",
                                              dict(body, kv_transfer_params=ticket, routed_dp_rank=0), None))
    await asyncio.sleep(0.3)
    status, data, _ = await cluster.post(cluster.decode_url + "/abort_request", {"rid": "queued-pull"}, None)
    assert status == 200, data
    while sum(w.num_leases for w in await cluster.prefill.controller.call_utility("stats")):
        assert asyncio.get_running_loop().time() - granted < 2.0  # released before the lease would have expired
        await asyncio.sleep(0.02)
    await decode
    await abort(cluster, filler, "filler-abort")
    assert await idle(cluster)


async def test_the_decode_reports_the_tokens_the_prefill_found_cached(cluster, unified):
    body = {"model": "tiny", "prompt": "Cached twice: " + LONG, "max_tokens": 4, **GREEDY}
    usages = []
    for _ in range(2):  # the second prefill finds the first's blocks (one prefill worker per ticket's rank)
        ticket = (await prefill_leg(cluster, dict(body, routed_dp_rank=0)))["kv_transfer_params"]
        status, data, _ = await cluster.post(cluster.decode_url + "/v1/completions", dict(body, kv_transfer_params=ticket), None)
        assert status == 200, data
        usages.append((ticket["remote_num_cached_tokens"], data["usage"]["prompt_tokens_details"]["cached_tokens"],
                       data["usage"]["prompt_tokens"]))
    # 119 prompt tokens: nothing cached the first time; 29 whole blocks (116 tokens) the second.
    assert usages == [(0, 0, 119), (116, 116, 119)]
    assert await idle(cluster)
