"""Our router, the real sglang-router (push flow) and the real vllm-router (pull flow) in front of
prefill and decode servers with different TP sizes get the unified TP 1 server's answers, and every
block comes back on both sides."""

import json
import sys

import aiohttp
import pytest
import pytest_asyncio

from disagg.router.config import PrefillEndpoint, RouterConfig
from disagg.router.server import RouterServer
from pd_cluster import start_tp_pd
from router_process import router_process

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]
GREEDY = {"temperature": 0, "ignore_eos": True, "max_tokens": 10}
LONG = "The quick brown fox jumps over the lazy dog, twice: " * 2  # several blocks, chunked prefill


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=[(2, 1), (1, 2), (2, 2)], ids=lambda p: f"p{p[0]}-d{p[1]}")
async def cluster(request):
    c = await start_tp_pd("tcp", *request.param)
    yield c
    await c.close()


def router_args(kind: str, cluster) -> list[str]:
    if kind == "sglang-router":
        pytest.importorskip("sglang_router", reason="sglang-router is a dev dependency: pip install -e '.[dev]'")
        return [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--prefill",
                cluster.prefill_url, str(cluster.prefill.bootstrap_port), "--decode", cluster.decode_url]
    pytest.importorskip("vllm_router", reason="vllm-router is a dev dependency: pip install -e '.[dev]'")
    return [sys.executable, "-m", "vllm_router.launch_router", "--vllm-pd-disaggregation",
            "--prefill", cluster.prefill_url, "--decode", cluster.decode_url]


async def answers(url: str) -> list[str]:
    """A completion of LONG and a streamed chat answer, as text."""
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/completions", json={"model": "tiny", "prompt": LONG, **GREEDY}) as r:
            assert r.status == 200, await r.text()
            completion = (await r.json())["choices"][0]["text"]
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "stream": True, **GREEDY}
        async with s.post(url + "/v1/chat/completions", json=chat) as r:
            assert r.status == 200, await r.text()
            raw = await r.text()
    chunks = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    return [completion, "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])]


async def unified_answers(url: str) -> list[str]:
    got = await answers(url)
    assert all(got)
    return got


@pytest.mark.parametrize("kind", ["ours", "sglang-router", "vllm-router"])
async def test_a_router_over_different_tp_sizes_gets_unified_answers(cluster, unified_url, kind, tmp_path):
    if kind == "ours":
        config = RouterConfig(port=0, prefill=(PrefillEndpoint(cluster.prefill_url, cluster.prefill.bootstrap_port),),
                              decode=(cluster.decode_url,), health_check_interval_s=0)
        async with RouterServer(config) as router:
            got = await answers(router.url)
    else:
        async with router_process(router_args(kind, cluster), tmp_path, kind) as url:
            got = await answers(url)
    assert got == await unified_answers(unified_url)
    assert await cluster.settled(([96], [96])) == ([96], [96])
