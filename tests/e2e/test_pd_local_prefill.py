"""Selective disaggregation end to end: a decode started with `--max-local-prefill-tokens` says so in its
/server_info; our router (`--policy cache_aware`) reads it there and sends a later turn whose uncached
rest is within it to the decode alone, which prefills it itself; a decode that finds more uncached than
its limit refuses (400), and the router sends the request again with a prefill. Outputs equal the
unified server's."""

import random

import pytest
import pytest_asyncio

from disagg.router.config import CacheAwareConfig, PrefillEndpoint, RouterConfig
from disagg.router.server import RouterServer
from pd_cluster import start_pd, unified_answer

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]
GREEDY = {"temperature": 0, "ignore_eos": True, "max_tokens": 12}
DECODE_LIMIT = 16


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster():
    c = await start_pd("tcp", dp_size=1, decode_options={"max_local_prefill_tokens": DECODE_LIMIT})
    yield c
    await c.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["push", "pull"])
async def router(request, cluster):
    bootstrap_port = cluster.prefill.bootstrap_port if request.param == "push" else None
    server = RouterServer(RouterConfig(
        port=0, protocol=request.param, policy="cache_aware", health_check_interval_s=0,
        cache_aware=CacheAwareConfig(local_prefill_min_prefill_load=0),  # the prefill is idle here
        prefill=(PrefillEndpoint(cluster.prefill_url, bootstrap_port),), decode=(cluster.decode_url,)))
    await server.start()
    yield server
    await server.close()


async def scrape(cluster, url: str) -> dict[str, float]:
    async with cluster.session.get(url + "/metrics") as r:
        lines = (await r.text()).splitlines()
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in lines if line and not line.startswith("#")}


async def routed(cluster, router, prompt: list[int]) -> str:
    status, data, _ = await cluster.post(router.url + "/v1/completions", {"model": "tiny", "prompt": prompt, **GREEDY}, None)
    assert status == 200, data
    return data["choices"][0]["text"]


def delta(after: dict, before: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


async def two_turns(cluster, unified, seed: str, num_new: int) -> tuple[list[int], str, list[int], str]:
    """A 41-token first turn, and a second: the first, its 12-token answer and `num_new` new tokens;
    each with the unified server's answer text."""
    rng = random.Random(seed)
    first = [rng.randrange(32, 127) for _ in range(41)]
    first_text, answer_ids = await unified_answer(cluster, unified, first)
    second = first + answer_ids + [rng.randrange(32, 127) for _ in range(num_new)]
    second_text, _ = await unified_answer(cluster, unified, second)
    return first, first_text, second, second_text


async def test_a_later_turn_with_a_short_rest_is_prefilled_by_the_decode_alone(cluster, router, unified):
    first, first_text, second, second_text = await two_turns(cluster, unified, f"turns-{router.config.protocol}", 3)
    before = [await scrape(cluster, url) for url in (router.url, cluster.decode_url, cluster.prefill_url)]
    assert await routed(cluster, router, first) == first_text  # nothing is cached anywhere: with a prefill
    # The router's decode tree holds the 41 first ids: 15 more are within the decode's 16 (which the router
    # read from its /server_info). The decode holds 52 of the 56 (13 full blocks of the first turn): 4 are.
    assert await routed(cluster, router, second) == second_text
    after = [await scrape(cluster, url) for url in (router.url, cluster.decode_url, cluster.prefill_url)]
    assert [delta(after[0], before[0], f'disagg_router_prefills_total{{where="{w}"}}') for w in ("local", "remote")] == [1, 1]
    assert [delta(after[1], before[1], f'disagg_decode_prefills_total{{where="{w}"}}') for w in ("local", "remote")] == [1, 1]
    assert delta(after[2], before[2], "disagg_prompt_tokens_total") == 41  # the prefill saw the first turn only
    assert delta(after[1], before[1], "disagg_kv_transfer_bytes_total") == (11 if router.config.protocol == "push" else 10) * 2048
    assert await cluster.settled(([96], [96])) == ([96], [96])


async def test_a_decode_sent_more_than_its_limit_refuses_and_the_router_adds_a_prefill(cluster, router, unified):
    first, _, second, second_text = await two_turns(cluster, unified, f"refused-{router.config.protocol}", 3)
    await routed(cluster, router, first)
    async with cluster.session.post(cluster.decode_url + "/reset_prefix_cache") as r:
        assert r.status == 200  # the decode forgets the first turn; the router's tree still holds it
    before = [await scrape(cluster, url) for url in (router.url, cluster.decode_url)]
    # The router counts 15 tokens past its tree (within 16); the decode finds all 56 uncached (over 16).
    assert await routed(cluster, router, second) == second_text
    after = [await scrape(cluster, url) for url in (router.url, cluster.decode_url)]
    assert delta(after[0], before[0], "disagg_router_local_prefills_refused_total") == 1
    assert [delta(after[0], before[0], f'disagg_router_prefills_total{{where="{w}"}}') for w in ("local", "remote")] == [1, 1]
    assert [delta(after[1], before[1], f'disagg_decode_prefills_total{{where="{w}"}}') for w in ("local", "remote")] == [0, 1]
    assert await cluster.settled(([96], [96])) == ([96], [96])


async def test_a_request_sent_to_the_decode_alone_over_its_limit_is_refused_naming_the_rule(cluster):
    prompt = [random.Random("alone").randrange(32, 127) for _ in range(30)]
    status, data, _ = await cluster.post(cluster.decode_url + "/v1/completions",
                                         {"model": "tiny", "prompt": prompt, **GREEDY}, None)
    assert (status, data["error"]["param"]) == (400, "bootstrap_room")
    assert data["error"]["message"] == (
        "30 of the prompt's 30 tokens are not in this decode's prefix cache; it prefills at most 16 itself "
        "(--max-local-prefill-tokens): send the request with a prefill (bootstrap_room, bootstrap_host and "
        "bootstrap_port, or kv_transfer_params)")
    assert await cluster.settled(([96], [96])) == ([96], [96])
