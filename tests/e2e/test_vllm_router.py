"""The real `vllm-router` (PyPI) drives our prefill and decode servers in vLLM's P/D mode
(`--vllm-pd-disaggregation`: the pull flow with kv_transfer_params) and gets unified's answers; in its
DP mode (`--intra-node-data-parallel-size 2`) it picks a DP rank on each server and sends it as
`X-data-parallel-rank`, and our answers name the decode rank it chose."""

import asyncio
import contextlib
import json
import re
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


@contextlib.asynccontextmanager
async def _vllm_router(backend: str, log_dir, *options: str):
    """A P/D cluster on `backend` behind the real vllm-router in P/D mode with `options`: yields (url, cluster)."""
    cluster = await start_pd(backend)
    args = [sys.executable, "-m", "vllm_router.launch_router", "--vllm-pd-disaggregation", *options,
            "--prefill", cluster.prefill_url, "--decode", cluster.decode_url]
    try:
        async with router_process(args, log_dir, "vllm-router") as url:
            yield url, cluster
    finally:
        await cluster.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["tcp", "nixl"])
async def router(request, tmp_path_factory):
    async with _vllm_router(request.param, tmp_path_factory.mktemp("vllm-router")) as pair:
        yield pair


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["tcp", "nixl"])
async def dp_router(request, tmp_path_factory):
    """DP mode: the router reads each server's engine count from /metrics (`engine` labels: 2), then
    sends `X-data-parallel-rank` on both legs; round_robin makes consecutive requests alternate ranks.
    It insists on an --api-key in this mode (sent to /v1/*/render only; our servers run without one)."""
    async with _vllm_router(request.param, tmp_path_factory.mktemp("vllm-router-dp"), "--policy", "round_robin",
                            "--intra-node-data-parallel-size", "2", "--api-key", "router-only-key") as pair:
        yield pair


def body_for(path: str, prompt: str, stream: bool) -> dict:
    if path == "/v1/completions":
        return {"model": "tiny", "prompt": prompt, "max_tokens": 12, "stream": stream, **GREEDY}
    return {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 12, "stream": stream, **GREEDY}


async def text_of(resp: aiohttp.ClientResponse, path: str, stream: bool) -> str:
    return await text_of_raw(await resp.text(), path, stream)


async def text_of_raw(raw: str, path: str, stream: bool) -> str:
    if not stream:
        choice = json.loads(raw)["choices"][0]
        return choice["text"] if path == "/v1/completions" else choice["message"]["content"]
    text = ""
    for line in raw.splitlines():
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
        if all(w.num_free_blocks == w.num_total_blocks for side in stats for w in side):
            break
        await asyncio.sleep(0.05)
    assert all(w.num_free_blocks == w.num_total_blocks for side in stats for w in side)


async def served_by_engine(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """`vllm:request_success_total` per engine (DP rank) of one server, every finish reason summed."""
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    counts: dict[str, float] = {}
    for engine, value in re.findall(r'^vllm:request_success_total\{[^}]*engine="(\d+)"[^}]*\} (\S+)$', text, re.M):
        counts[engine] = counts.get(engine, 0.0) + float(value)
    return counts


def ranks_named(resp: aiohttp.ClientResponse, body: str, stream: bool) -> set[int]:
    """The DP ranks an answer names: its X-data-parallel-rank header and every body's `dp_rank`."""
    bodies = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")] if stream else [json.loads(body)]
    return {int(resp.headers["X-data-parallel-rank"])} | {b["dp_rank"] for b in bodies}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_vllm_router_dp_mode_routes_each_rank_and_equals_unified(dp_router, unified_url, path, stream):
    url, cluster = dp_router
    async with aiohttp.ClientSession() as s:
        ranks = []
        for prompt in ("hi", LONG):  # round_robin: one request on each DP rank of both servers
            body = body_for(path, prompt, stream)
            async with s.post(unified_url + path, json=dict(body, stream=False)) as r:
                expected = await text_of(r, path, False)
            before = [await served_by_engine(s, u) for u in (cluster.prefill_url, cluster.decode_url)]
            async with s.post(url + path, json=body) as r:
                raw = await r.text()
                assert r.status == 200, raw
                named = ranks_named(r, raw, stream)
            got = await text_of_raw(raw, path, stream)
            assert got == expected and got
            after = [await served_by_engine(s, u) for u in (cluster.prefill_url, cluster.decode_url)]
            served = [{e for e in a if a[e] != b.get(e, 0.0)} for b, a in zip(before, after)]
            (rank,) = named  # header and bodies agree
            assert served == [{str(rank)}, {str(rank)}]  # the router paired prefill rank r with decode rank r
            ranks.append(rank)
    assert sorted(ranks) == [0, 1]
