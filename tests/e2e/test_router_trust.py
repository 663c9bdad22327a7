"""Our router owns the internal fields, end to end (real router, real servers, tcp KV transfers): a
client's `kv_transfer_params` and `bootstrap_*` never reach a server, so a request carrying them is
answered as any other, and no connection reaches the address they name; the client's DP routing is
dropped unless the router runs with --trust-client-routing. Every test leaves every block free."""

import asyncio
import contextlib
import time

import pytest
import pytest_asyncio

from disagg.router.config import PrefillEndpoint, RouterConfig
from disagg.router.server import RouterServer
from pd_cluster import counting_listener

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]
GREEDY = {"temperature": 0, "ignore_eos": True}
BODY = {"model": "tiny", "prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": 6, **GREEDY}
START = ([96, 96], [96, 96])  # free blocks per DP worker, prefill and decode


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def expected(unified):
    """The unified server's text for BODY: what every P/D answer here must equal."""
    import aiohttp

    async with aiohttp.ClientSession() as s, s.post(f"http://127.0.0.1:{unified.port}/v1/completions", json=BODY) as r:
        return (await r.json())["choices"][0]["text"]


@contextlib.asynccontextmanager
async def router(cluster, **options):
    config = RouterConfig(host="127.0.0.1", port=0, health_check_interval_s=0, request_timeout_s=60,
                          prefill=(PrefillEndpoint(cluster.prefill_url, cluster.prefill.bootstrap_port),),
                          decode=(cluster.decode_url,), **options)
    async with RouterServer(config) as running:
        yield running.url


def ticket(port: int) -> dict:
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "prefill-0",
            "remote_host": "127.0.0.1", "remote_port": port, "remote_request_id": "forged", "remote_block_ids": [0, 1]}


@pytest.mark.parametrize("protocol", ["push", "pull"])
@pytest.mark.parametrize("params", ["do_remote_decode", "ticket"])
async def test_a_client_kv_transfer_params_and_bootstrap_fields_never_reach_a_server(cluster, expected, protocol, params):
    """Sent to the servers, `do_remote_decode` would leave the decode waiting for a push that never
    comes (300 s), and the ticket (or bootstrap_port) would make the decode connect to the listener."""
    async with counting_listener() as (port, accepted), router(cluster, protocol=protocol) as url:
        kv = {"do_remote_decode": True} if params == "do_remote_decode" else ticket(port)
        body = dict(BODY, kv_transfer_params=kv, bootstrap_host="127.0.0.1", bootstrap_port=port, bootstrap_room=5)
        started = time.monotonic()
        async with cluster.session.post(url + "/v1/completions", json=body) as r:
            status, data = r.status, await r.json()
        elapsed = time.monotonic() - started
        await asyncio.sleep(0.1)  # a connection the decode might open late would be counted now
    assert (status, data["choices"][0]["text"]) == (200, expected), data
    assert elapsed < 1.0, elapsed
    assert len(accepted) == 0
    assert await cluster.settled(START) == START


async def test_client_routing_is_dropped_by_default_and_honoured_with_trust_client_routing(cluster, expected):
    """Rank 7 does not exist (dp_size 2): honoured, it is the servers' 400; dropped, the request is served."""
    out_of_range = [({"routed_dp_rank": 7}, None), ({"data_parallel_rank": 7}, None), ({}, {"X-data-parallel-rank": "7"})]
    async with router(cluster) as default, router(cluster, trust_client_routing=True) as trusting:
        for fields, headers in out_of_range:
            answers = []
            for url in (default, trusting):
                async with cluster.session.post(url + "/v1/completions", json=dict(BODY, **fields), headers=headers) as r:
                    answers.append((r.status, await r.json()))
            assert (answers[0][0], answers[0][1]["choices"][0]["text"]) == (200, expected)
            assert answers[1] == (400, {"error": {"message": "DP rank 7 is not active (dp_size=2)",
                                                  "type": "BadRequestError", "param": "routed_dp_rank", "code": None}})
        ranks = []
        pinned = dict(BODY, routed_dp_rank=1, disagg_prefill_dp_rank=1)  # both legs: DP rank 1, the KV on prefill rank 1
        for _ in range(3):  # every answer from decode DP rank 1, whatever the load balancer would pick
            async with cluster.session.post(trusting + "/v1/completions", json=pinned) as r:
                data = await r.json()
                ranks.append((r.status, data["dp_rank"], r.headers["X-data-parallel-rank"], data["choices"][0]["text"]))
    assert ranks == [(200, 1, "1", expected)] * 3
    assert await cluster.settled(START) == START


async def test_a_server_sent_pull_params_and_a_room_refuses_them_at_once(cluster):
    """Straight to the servers (no router to drop them): the pull flow's flags with a push room cannot
    complete, so both servers answer 400 at once, before the decode connects anywhere."""
    message = ("kv_transfer_params with do_remote_decode or do_remote_prefill (the pull flow) and bootstrap_room "
               "(the push flow) cannot be combined: a request takes one P/D flow (send it through one P/D router)")
    async with counting_listener() as (port, accepted):
        prefill = cluster.pd_body(dict(BODY, kv_transfer_params={"do_remote_decode": True}))
        decode = cluster.pd_body(dict(BODY, kv_transfer_params=ticket(port)))
        started = time.monotonic()
        answers = await asyncio.gather(cluster.post(cluster.prefill_url + "/v1/completions", prefill, None),
                                       cluster.post(cluster.decode_url + "/v1/completions", decode, None))
        elapsed = time.monotonic() - started
    error = {"error": {"message": message, "type": "BadRequestError", "param": "kv_transfer_params", "code": None}}
    assert [(status, data) for status, data, _ in answers] == [(400, error), (400, error)]
    assert elapsed < 1.0 and len(accepted) == 0
    assert await cluster.settled(START) == START
