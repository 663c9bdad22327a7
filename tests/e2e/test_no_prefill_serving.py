"""A P/D cluster with no prefill serving: the last prefill switched to decode (as the planner does when
the load is light), our router (`--policy cache_aware`) sends every request to a decode that prefills
locally, marked `disagg_prefill_here`, and that decode prefills the whole prompt whatever its
`--max-local-prefill-tokens`; answers equal the unified server's, say `X-Disagg-Path: decode-local`
with `no_prefill_server`, and move no KV. The prefill back, long prompts go through it again."""

import asyncio
import random

import aiohttp
import pytest
import pytest_asyncio

from disagg.config import ServerConfig
from disagg.launch import start_server
from disagg.router.config import PlannerConfig, PrefillEndpoint, RouterConfig
from disagg.router.server import RouterServer
from pd_cluster import TINY, Cluster, pd_config, unified_answer

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]
GREEDY = {"temperature": 0, "ignore_eos": True, "max_tokens": 12}
LIMIT = 16  # both servers' --max-local-prefill-tokens: every prompt here is longer


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster():
    disagg = pd_config("tcp", max_local_prefill_tokens=LIMIT)

    def config(mode: str, method: str) -> ServerConfig:
        return ServerConfig(port=0, dp_size=1, disaggregation_mode=mode, load_balance_method=method,
                            enable_pd_role_switch=True)
    prefill, decode = await asyncio.gather(
        start_server(config("prefill", "follow_bootstrap_room"), TINY, disagg, lambda _: None),
        start_server(config("decode", "least_load"), TINY, disagg, lambda _: None))
    c = Cluster(prefill, decode, aiohttp.ClientSession())
    yield c
    await c.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def router(cluster):
    server = RouterServer(RouterConfig(
        port=0, policy="cache_aware", health_check_interval_s=5.0,
        prefill=(PrefillEndpoint(cluster.prefill_url, cluster.prefill.bootstrap_port),), decode=(cluster.decode_url,)))
    await server.start()
    yield server
    await server.close()


async def roles(cluster, router) -> dict[str, list[str]]:
    async with cluster.session.get(router.url + "/workers") as r:
        listing = await r.json()
    return {role: sorted(w["url"] for w in listing[role] if not w.get("draining")) for role in ("prefill", "decode")}


async def switched(cluster, router, new_role: str, expected: dict[str, list[str]]) -> None:
    status, answer, _ = await cluster.post(cluster.prefill_url + "/pd_role_switch", {"new_role": new_role}, None)
    assert (status, answer["disaggregation_mode"]) == (200, new_role), answer
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 2.0
    while (seen := await roles(cluster, router)) != expected:
        assert loop.time() < deadline, f"the router still sees {seen}"
        await asyncio.sleep(0.05)


async def metric(cluster, url: str, name: str) -> float:
    async with cluster.session.get(url + "/metrics") as r:
        lines = (await r.text()).splitlines()
    return sum(float(line.rpartition(" ")[2]) for line in lines if line.startswith(name + " "))


def prompt_of(seed: str, n: int = 41) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32, 127) for _ in range(n)]


async def test_with_the_last_prefill_switched_to_decode_the_decodes_prefill_every_prompt(cluster, router, unified):
    p_url, d_url = cluster.prefill_url, cluster.decode_url
    prompts = [prompt_of(f"whole-{i}") for i in range(6)]
    expected = [(await unified_answer(cluster, unified, p))[0] for p in prompts]
    status, data, headers = await cluster.post(router.url + "/v1/completions",
                                               {"model": "tiny", "prompt": prompts[0], **GREEDY}, None)
    assert (status, data["choices"][0]["text"], headers["X-Disagg-Path"]) == (200, expected[0], "pd")

    await switched(cluster, router, "decode", {"prefill": [], "decode": sorted([p_url, d_url])})
    before = {url: await metric(cluster, url, 'disagg_decode_prefills_total{where="local"}') for url in (p_url, d_url)}
    kv_before = await cluster.decode_kv_bytes()
    answers = await asyncio.gather(*(cluster.post(router.url + "/v1/completions",
                                                  {"model": "tiny", "prompt": p, **GREEDY}, None) for p in prompts[1:]))
    assert [(s, d["choices"][0]["text"]) for s, d, _ in answers] == [(200, text) for text in expected[1:]]
    assert {(h["X-Disagg-Path"], h["X-Disagg-Path-Reason"]) for _, _, h in answers} == {
        ("decode-local", "no_prefill_server")}
    status, stream, headers = await cluster.post(router.url + "/v1/completions",
                                                 {"model": "tiny", "prompt": prompts[2], "stream": True, **GREEDY}, None)
    assert (status, headers["X-Disagg-Path-Reason"], stream.endswith("data: [DONE]\n\n")) == (200, "no_prefill_server", True)
    after = {url: await metric(cluster, url, 'disagg_decode_prefills_total{where="local"}') for url in (p_url, d_url)}
    assert sum(after[u] - before[u] for u in after) == 6  # 41 tokens each, past both limits of 16
    assert await cluster.decode_kv_bytes() == kv_before  # no KV moved
    assert await metric(cluster, router.url, 'disagg_router_answers_total{path="decode-local",reason="no_prefill_server"}') == 6

    await switched(cluster, router, "prefill", {"prefill": [p_url], "decode": [d_url]})
    long_one = prompt_of("whole-after")
    status, data, headers = await cluster.post(router.url + "/v1/completions",
                                               {"model": "tiny", "prompt": long_one, **GREEDY}, None)
    assert (status, data["choices"][0]["text"], headers["X-Disagg-Path"]) == (
        200, (await unified_answer(cluster, unified, long_one))[0], "pd")
    assert await cluster.settled(([96], [96])) == ([96], [96])


async def test_a_client_cannot_mark_a_request_prefill_here_through_the_router(cluster, router, unified):
    """The field is the router's (as bootstrap_room is): a client's copy is dropped, so a long prompt still
    goes through the prefill; sent to a decode directly with a room, the decode refuses it."""
    prompt = prompt_of("client-marked")
    status, data, headers = await cluster.post(router.url + "/v1/completions",
                                               {"model": "tiny", "prompt": prompt, "disagg_prefill_here": True, **GREEDY}, None)
    assert (status, data["choices"][0]["text"], headers["X-Disagg-Path"]) == (
        200, (await unified_answer(cluster, unified, prompt))[0], "pd")
    body = cluster.pd_body({"model": "tiny", "prompt": prompt, "disagg_prefill_here": True, **GREEDY})
    status, data, _ = await cluster.post(cluster.decode_url + "/v1/completions", body, None)
    assert (status, data["error"]["param"], data["error"]["message"]) == (
        400, "disagg_prefill_here", "disagg_prefill_here asks this decode to prefill the prompt itself: send it without "
        "bootstrap_room and kv_transfer_params (those name a prefill that computes it)")
    assert await cluster.settled(([96], [96])) == ([96], [96])


async def test_the_planner_moves_a_lightly_loaded_last_prefill_to_decode(cluster, unified):
    """`--planner auto` with cache_aware: the one prefill's prompt load stays far under 1 (its rate) on
    the tiny model, so the planner makes it a decode; the answers stay unified's, and then go decode-local."""
    planned = RouterServer(RouterConfig(
        port=0, policy="cache_aware", health_check_interval_s=5.0,
        prefill=(PrefillEndpoint(cluster.prefill_url, cluster.prefill.bootstrap_port),), decode=(cluster.decode_url,),
        planning=PlannerConfig(planner="auto", planner_interval_s=0.5)))
    prompts = [prompt_of(f"planned-{i}") for i in range(4)]
    expected = [(await unified_answer(cluster, unified, p))[0] for p in prompts]
    await planned.start()
    try:
        loop = asyncio.get_running_loop()
        deadline, texts = loop.time() + 20, []
        while (await roles(cluster, planned))["prefill"]:
            assert loop.time() < deadline, "the planner moved nothing in 20 s"
            answers = await asyncio.gather(*(cluster.post(planned.url + "/v1/completions",
                                                          {"model": "tiny", "prompt": p, **GREEDY}, None) for p in prompts))
            texts += [d["choices"][0]["text"] for _, d, _ in answers]
        assert texts == expected * (len(texts) // len(prompts))
        answers = await asyncio.gather(*(cluster.post(planned.url + "/v1/completions",
                                                      {"model": "tiny", "prompt": p, **GREEDY}, None) for p in prompts))
        assert [(d["choices"][0]["text"], h["X-Disagg-Path-Reason"]) for _, d, h in answers] == [
            (text, "no_prefill_server") for text in expected]
        async with cluster.session.get(planned.url + "/metrics") as r:
            metrics = await r.text()
        assert 'disagg_planner_decisions_total{action="prefill_to_decode",confirmed="true"} 1.0' in metrics
        assert 'disagg_planner_servers{role="prefill"} 0.0' in metrics
    finally:
        await planned.close()
    status, answer, _ = await cluster.post(cluster.prefill_url + "/pd_role_switch", {"new_role": "prefill"}, None)
    assert status == 200, answer  # as the other tests found it
    assert await cluster.settled(([96], [96])) == ([96], [96])
