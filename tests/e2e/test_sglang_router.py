"""The real `sglang-router` (PyPI) drives our prefill and decode servers unchanged."""

import asyncio
import json
import sys

import aiohttp
import pytest
import pytest_asyncio

from pd_cluster import start_pd
from router_process import router_process

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]
pytest.importorskip("sglang_router", reason="sglang-router is a dev dependency: pip install -e '.[dev]'")
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def router(tmp_path_factory):
    cluster = await start_pd("tcp")
    args = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
            "--prefill", cluster.prefill_url, str(cluster.prefill.bootstrap_port), "--decode", cluster.decode_url]
    try:
        async with router_process(args, tmp_path_factory.mktemp("sglang-router"), "sglang-router") as url:
            yield url
    finally:
        await cluster.close()


async def post(url: str, body: dict):
    async with aiohttp.ClientSession() as s:
        async with s.post(url, json=body) as r:
            return r.status, await (r.text() if body.get("stream") else r.json())


async def test_generate(router, unified_url):
    body = {"text": "sglang router", "sampling_params": {"max_new_tokens": 8, **GREEDY}}
    status, data = await post(router + "/generate", body)
    assert status == 200, data
    assert data["output_ids"] == (await post(unified_url + "/generate", body))[1]["output_ids"]
    assert len(data["output_ids"]) == 8


async def test_completions(router, unified_url):
    body = {"model": "tiny", "prompt": "sglang router", "max_tokens": 8, **GREEDY}
    status, data = await post(router + "/v1/completions", body)
    assert status == 200, data
    assert data["choices"][0]["text"] == (await post(unified_url + "/v1/completions", body))[1]["choices"][0]["text"]


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_completions(router, unified_url, stream):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "stream": stream, **GREEDY}
    status, data = await post(router + "/v1/chat/completions", body)
    assert status == 200, data
    expected = (await post(unified_url + "/v1/chat/completions", dict(body, stream=False)))[1]["choices"][0]["message"]["content"]
    if stream:
        chunks = [json.loads(line[6:]) for line in data.splitlines() if line.startswith("data: {")]
        assert data.rstrip().endswith("data: [DONE]")
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == expected
    else:
        assert data["choices"][0]["message"]["content"] == expected


async def test_router_reads_our_get_load(router):
    """The router's /get_loads asks every worker's /get_load and sums `num_tokens` (-1 when that
    fails): idle, our prefill and decode servers hold no KV tokens."""
    async with aiohttp.ClientSession() as s:
        for _ in range(40):  # workers report their load every 0.5 s: earlier tests' requests fade out
            async with s.get(router + "/get_loads") as r:
                status, body = r.status, await r.json()
            if sorted(w["load"] for w in body["workers"]) == [0, 0]:
                break
            await asyncio.sleep(0.25)
    assert (status, sorted(w["load"] for w in body["workers"])) == (200, [0, 0])
