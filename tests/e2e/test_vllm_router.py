"""The real `vllm-router` (PyPI) drives our prefill and decode servers in vLLM's P/D mode
(`--vllm-pd-disaggregation`: the pull flow with kv_transfer_params) and gets unified's answers."""

import asyncio
import json
import sys

import aiohttp
import pytest
import pytest_asyncio

from pd_cluster import start_pd
from router_process import router_process

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]
pytest.importorskip("vllm_router", reason="vllm-router is a dev dependency: pip install -e '.[dev]'")
GREEDY = {"temperature": 0, "ignore_eos": True}
LONG = "The quick brown fox jumps over the lazy dog, twice: " * 2


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["tcp", "nixl"])
async def router(request, tmp_path_factory):
    cluster = await start_pd(request.param)
    args = [sys.executable, "-m", "vllm_router.launch_router", "--vllm-pd-disaggregation",
            "--prefill", cluster.prefill_url, "--decode", cluster.decode_url]
    try:
        async with router_process(args, tmp_path_factory.mktemp("vllm-router"), "vllm-router") as url:
            yield url, cluster
    finally:
        await cluster.close()


def body_for(path: str, prompt: str, stream: bool) -> dict:
    if path == "/v1/completions":
        return {"model": "tiny", "prompt": prompt, "max_tokens": 12, "stream": stream, **GREEDY}
    return {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 12, "stream": stream, **GREEDY}


async def text_of(resp: aiohttp.ClientResponse, path: str, stream: bool) -> str:
    key = "text" if path == "/v1/completions" else "content"
    if not stream:
        data = await resp.json()
        choice = data["choices"][0]
        return choice["text"] if key == "text" else choice["message"]["content"]
    text = ""
    for line in (await resp.text()).splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("prompt", ["hi", LONG], ids=["short", "long"])
async def test_vllm_router_pd_equals_unified(router, unified_url, path, stream, prompt):
    url, cluster = router
    body = body_for(path, prompt, stream)
    async with aiohttp.ClientSession() as s:
        async with s.post(unified_url + path, json=dict(body, stream=False)) as r:
            expected = await text_of(r, path, False)
        async with s.post(url + path, json=body) as r:
            assert r.status == 200, await r.text()
            got = await text_of(r, path, stream)
    assert got == expected and got
    for _ in range(100):  # the decode released the prefill's lease: every block is free again
        stats = [await srv.controller.call_utility("stats") for srv in (cluster.prefill, cluster.decode)]
        if all(w["num_free_blocks"] == w["num_total_blocks"] for side in stats for w in side):
            break
        await asyncio.sleep(0.05)
    assert all(w["num_free_blocks"] == w["num_total_blocks"] for side in stats for w in side)
