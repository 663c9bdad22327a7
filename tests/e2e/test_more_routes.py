"""vLLM's /load, /tokenizer_info and SageMaker's /invocations on a real server (tiny model) and
through our router on P/D: /load counts the generate requests being served; /tokenizer_info answers
only when enabled; /invocations answers a chat body as /v1/chat/completions and a completions body as
/v1/completions, the same tokens, and refuses anything else with a 400 that says what it takes."""

import asyncio

import aiohttp
import pytest

from disagg.config import ServerConfig
from disagg.launch import start_server
from disagg.pd_config import DisaggConfig
from disagg.router.config import PrefillEndpoint, RouterConfig
from disagg.router.server import RouterServer
from pd_cluster import TINY, start_pd

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]
COMPLETION = {"prompt": "Hello there", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 5, "temperature": 0, "ignore_eos": True}
REFUSED = {"error": {"message": "an /invocations body is a chat completion (with messages) or a completion (with "
                                "prompt)", "type": "BadRequestError", "param": None, "code": None}}


async def post(session, url, body):
    async with session.post(url, json=body) as r:
        return r.status, await r.json()


async def same_answers(session: aiohttp.ClientSession, base: str) -> None:
    for route, body, field in (("/v1/completions", COMPLETION, "text"), ("/v1/chat/completions", CHAT, "message")):
        status, direct = await post(session, base + route, body)
        status2, invoked = await post(session, base + "/invocations", body)
        assert (status, status2, invoked["object"]) == (200, 200, direct["object"])
        assert invoked["choices"][0][field] == direct["choices"][0][field]
        assert [invoked["usage"][k] for k in ("prompt_tokens", "completion_tokens")] == \
            [direct["usage"][k] for k in ("prompt_tokens", "completion_tokens")]
    assert await post(session, base + "/invocations", {"input": "x"}) == (400, REFUSED)


async def test_load_tokenizer_info_and_invocations_on_a_server():
    server = await start_server(ServerConfig(port=0, dp_size=1, enable_tokenizer_info_endpoint=True,
                                             enable_fault_injection=True), TINY, DisaggConfig(), lambda _: None)
    plain = await start_server(ServerConfig(port=0, dp_size=1), TINY, DisaggConfig(), lambda _: None)
    base = f"http://127.0.0.1:{server.port}"
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(base + "/tokenizer_info") as r:
                info = await r.json()
            assert (r.status, info["name_or_path"], info["tokenizer_class"]) == (200, "tiny", "PreTrainedTokenizerFast")
            assert info["vocab_size"] == 320 and isinstance(info["added_special_tokens"], list)
            async with session.get(f"http://127.0.0.1:{plain.port}/tokenizer_info") as r:
                assert r.status == 404  # opt-in, as vLLM's
            await same_answers(session, base)
            async with session.get(base + "/load") as r:
                assert (r.status, await r.json()) == (200, {"server_load": 0})
            async with session.post(base + "/faults", json={"fault": "slow_steps", "dp_rank": 0, "ms": 50}) as r:
                assert r.status == 200
            running = [asyncio.create_task(post(session, base + "/v1/completions", dict(COMPLETION, max_tokens=20)))
                       for _ in range(3)]
            for _ in range(100):
                async with session.get(base + "/load") as r:
                    load = (await r.json())["server_load"]
                if load == 3:
                    break
                await asyncio.sleep(0.01)
            assert load == 3
            assert [s for s, _ in await asyncio.gather(*running)] == [200, 200, 200]
            async with session.get(base + "/load") as r:
                assert await r.json() == {"server_load": 0}
    finally:
        await server.close()
        await plain.close()


async def test_through_the_router_on_pd():
    cluster = await start_pd("tcp", server={"enable_tokenizer_info_endpoint": True}, dp_size=1)
    router = RouterServer(RouterConfig(port=0, health_check_interval_s=0, decode=(cluster.decode_url,),
                                       prefill=(PrefillEndpoint(cluster.prefill_url, cluster.prefill.bootstrap_port),)))
    await router.start()
    try:
        await same_answers(cluster.session, router.url)
        async with cluster.session.get(router.url + "/tokenizer_info") as r:
            assert (r.status, (await r.json())["vocab_size"]) == (200, 320)
        async with cluster.session.get(router.url + "/load") as r:
            assert (r.status, await r.json()) == (200, {"server_load": 0})
    finally:
        await router.close()
        await cluster.close()
