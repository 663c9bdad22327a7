"""Our router's cache_aware pick fed by the prefill workers' KV events (`--prefill-kv-events`): a
prompt primed on prefill DP rank 1 behind the router's back is routed to rank 1, which the router's
own trees never saw; text prompts are tokenized by the prefill's /tokenize for the match."""

import random

import aiohttp
import pytest
import pytest_asyncio

from disagg.config import ServerConfig
from disagg.kv_events_config import parse_kv_events_config
from disagg.launch import start_server
from disagg.router.config import CacheAwareConfig, PrefillEndpoint, RouterConfig
from disagg.router.server import RouterServer
from disagg.router.workers import Role
from pd_cluster import TINY, Cluster, pd_config, start_decode, until

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]
GREEDY = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def setup(tmp_path_factory):
    endpoint = f"ipc://{tmp_path_factory.mktemp('kv') / 'events'}"  # the workers bind it (+ _dp<rank>)
    events = parse_kv_events_config(f'{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "{endpoint}"}}')
    disagg = pd_config("tcp")
    prefill = await start_server(ServerConfig(port=0, dp_size=2, disaggregation_mode="prefill",
                                              load_balance_method="follow_bootstrap_room"),
                                 TINY, disagg, lambda _: None, kv_events=events)
    decode = await start_decode(disagg, dp_size=1)
    cluster = Cluster(prefill, decode, aiohttp.ClientSession())
    router = RouterServer(RouterConfig(
        port=0, policy="cache_aware", health_check_interval_s=0, cache_aware=CacheAwareConfig(prefill_kv_events=(endpoint,)),
        prefill=(PrefillEndpoint(cluster.prefill_url, prefill.bootstrap_port),), decode=(cluster.decode_url,)))
    await router.start()
    yield cluster, router
    await router.close()
    await cluster.close()


async def on_rank(cluster, rank: int, body: dict, path: str = "/generate") -> dict:
    """One P/D request pinned to prefill DP rank `rank`, past the router."""
    pd = cluster.pd_body(body)
    (p_status, _, _), (status, data, _) = await cluster.post_both(
        path, dict(pd, routed_dp_rank=rank, disagg_prefill_dp_rank=rank), dict(pd, disagg_prefill_dp_rank=rank))
    assert (p_status, status) == (200, 200), data
    return data


async def subscribed(cluster, router) -> tuple[int, object]:
    """Both ranks have published (a request each, repeated until the router's subscription caught one)."""
    index, server = router.router.kv_index, router.router.pool.ids(Role.PREFILL)[0]
    rng = random.Random("warm")
    for rank in (0, 1):
        warm = lambda rank=rank: on_rank(cluster, rank, {"input_ids": [rng.randrange(150, 250) for _ in range(9)],  # noqa: E731
                                                         "sampling_params": GREEDY})
        await until(lambda rank=rank: index.knows((server, rank)), f"rank {rank}'s events", warm)
    return server, index


async def test_a_prompt_primed_on_rank_1_is_routed_there_by_its_events(setup):
    cluster, router = setup
    server, index = await subscribed(cluster, router)
    prompt = [random.Random("primed").randrange(32, 127) for _ in range(41)]
    await on_rank(cluster, 1, {"input_ids": prompt, "sampling_params": GREEDY})
    await until(lambda: index.match_tokens((server, 1), prompt) == 40, "rank 1's blocks of the prompt")
    status, data, _ = await cluster.post(router.url + "/generate", {"input_ids": prompt, "sampling_params": GREEDY}, None)
    # The router's trees never saw the prompt (a miss would take rank 0); rank 1's 10 full blocks are hit.
    assert (status, data["meta_info"]["cached_tokens"]) == (200, 40)
    assert index.match_tokens((server, 0), prompt) == 0


async def test_a_text_prompt_is_tokenized_by_the_prefill_for_the_match(setup):
    cluster, router = setup
    server, index = await subscribed(cluster, router)
    text = "Primed behind the router's back, " * 2  # 66 characters: 67 tokens with BOS
    # Prime the rank the router's trees would not pick for a new prompt (a miss takes the smallest tree).
    trees = router.router.picker.prefill.trees
    primed = 1 - min((0, 1), key=lambda rank: (trees.size((server, rank)), rank))
    before = index.num_blocks((server, primed))
    await on_rank(cluster, primed, {"model": "tiny", "prompt": text, "max_tokens": 4, "temperature": 0}, "/v1/completions")
    await until(lambda: index.num_blocks((server, primed)) >= before + 16, "the primed rank's blocks of the text")
    status, data, _ = await cluster.post(router.url + "/v1/completions",
                                         {"model": "tiny", "prompt": text, "max_tokens": 4, "temperature": 0}, None)
    assert (status, data["usage"]["prompt_tokens"], data["usage"]["prompt_tokens_details"]["cached_tokens"]) == (200, 67, 64)
