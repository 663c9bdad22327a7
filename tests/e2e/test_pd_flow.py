"""Prefill + decode end to end (real worker processes, real HTTP, real KV transfers): the output
equals the unified server's token for token, on every generate endpoint, both backends."""

import asyncio
import json

import aiohttp
import pytest
import pytest_asyncio

from pd_cluster import start_pd

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]
SHORT = "hi"  # BOS + 2 bytes: less than one 4-token block
LONG = "The quick brown fox jumps over the lazy dog, twice: " * 2  # > 100 tokens: chunked prefill
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["tcp", "nixl"])
async def cluster(request):
    c = await start_pd(request.param)
    yield c
    await c.close()


async def unified_post(unified, path, body):
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{unified.port}{path}", json=body) as r:
            return await (r.json() if not body.get("stream") else r.text())


def body_for(path: str, prompt: str, stream: bool = False) -> dict:
    if path == "/generate":
        return {"text": prompt, "sampling_params": {"max_new_tokens": 12, **GREEDY}, "stream": stream}
    if path == "/v1/completions":
        return {"model": "tiny", "prompt": prompt, "max_tokens": 12, "stream": stream, **GREEDY}
    if path == "/v1/chat/completions":
        return {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 12, "stream": stream, **GREEDY}
    return {"token_ids": list(prompt.encode()), "sampling_params": {"max_tokens": 12, **GREEDY}, "stream": stream}


def answer(path: str, data: dict):
    """What must match between P/D and unified: token ids where the endpoint returns them, else text."""
    if path == "/generate":
        return data["output_ids"]
    if path == "/inference/v1/generate":
        return data["choices"][0]["token_ids"]
    if path == "/v1/completions":
        return data["choices"][0]["text"]
    return data["choices"][0]["message"]["content"]


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions", "/inference/v1/generate"])
@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["short", "long"])
async def test_pd_equals_unified(cluster, unified, path, prompt):
    body = body_for(path, prompt)
    pd = cluster.pd_body(body)
    (p_status, p_data, _), (d_status, d_data, _) = await cluster.post_both(path, pd, pd)
    assert (p_status, d_status) == (200, 200), (p_data, d_data)
    expected = answer(path, await unified_post(unified, path, body))
    assert answer(path, d_data) == expected
    if path == "/generate":
        assert len(expected) == 12 and p_data["output_ids"] == expected[:1]  # the prefill answers its one token


def sse_payloads(raw: str) -> list:
    return [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.mark.parametrize("path", ["/v1/completions", "/generate"])
async def test_streaming_pd_equals_unified(cluster, unified, path):
    body = body_for(path, LONG, stream=True)
    pd = cluster.pd_body(body)
    _, (d_status, raw, _) = await cluster.post_both(path, dict(pd, stream=False), pd)
    assert d_status == 200 and raw.rstrip().endswith("data: [DONE]")
    expected = answer(path, await unified_post(unified, path, dict(body, stream=False)))
    chunks = sse_payloads(raw)
    if path == "/v1/completions":
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == expected
    else:
        assert chunks[-1]["output_ids"] == expected


async def test_prefix_hit_on_prefill_gives_the_same_tokens(cluster, unified):
    body = body_for("/generate", LONG)
    outs = []
    for room in (10, 12):  # even rooms: the same prefill DP worker (follow_bootstrap_room), so its cache is hit
        pd = cluster.pd_body(body, room)
        (_, p_data, _), (_, d_data, _) = await cluster.post_both("/generate", pd, pd)
        outs.append((p_data["meta_info"]["cached_tokens"], d_data["meta_info"]["cached_tokens"], d_data["output_ids"]))
    assert outs[1][0] > 0 and outs[1][0] % 4 == 0  # whole blocks reused on the second prefill
    assert [o[1] for o in outs] == [o[0] for o in outs]  # the decode's usage reports the prefill's hits
    assert outs[0][2] == outs[1][2] == answer("/generate", await unified_post(unified, "/generate", body))


async def test_decode_without_room_is_400_naming_the_fields(cluster):
    async with cluster.session.post(cluster.decode_url + "/generate", json=body_for("/generate", SHORT)) as r:
        data = await r.json()
    assert r.status == 400
    assert data["error"]["message"].startswith("a decode request needs bootstrap_room, bootstrap_host, bootstrap_port")


async def test_abort_mid_stream_frees_blocks_on_both_sides(cluster):
    before = await cluster.free_blocks()
    body = cluster.pd_body({"text": LONG, "sampling_params": {"max_new_tokens": 400, **GREEDY}, "stream": True})
    prefill = asyncio.create_task(cluster.post(cluster.prefill_url + "/generate", dict(body, stream=False), None))
    async with cluster.session.post(cluster.decode_url + "/generate", json=body) as resp:
        await resp.content.readline()  # first chunk arrived: the KV moved, decoding runs
    await prefill
    for _ in range(100):
        if await cluster.free_blocks() == before:
            break
        await asyncio.sleep(0.05)
    assert await cluster.free_blocks() == before == ([96, 96], [96, 96])


async def test_kv_metrics_on_both_servers(cluster):
    async def scrape(url):
        async with cluster.session.get(url + "/metrics") as r:
            return {line.split(" ")[0]: float(line.split(" ")[1]) for line in (await r.text()).splitlines()
                    if line and not line.startswith("#")}

    before_p, before_d = await scrape(cluster.prefill_url), await scrape(cluster.decode_url)
    # A prompt no decode worker holds (a held prefix is not sent again: test_pd_prefix_reuse.py).
    pd = cluster.pd_body(body_for("/generate", LONG.upper()))
    await cluster.post_both("/generate", pd, pd)
    after_p, after_d = await scrape(cluster.prefill_url), await scrape(cluster.decode_url)
    delta = lambda after, before, name: after[name] - before.get(name, 0.0)  # noqa: E731
    # 105 tokens = 27 blocks; a block is 2 layers x (K, V) x 4 tokens x 2 kv heads x 16 dims x 4 bytes
    assert delta(after_p, before_p, "disagg_kv_transfer_bytes_total") == 27 * 2048
    assert delta(after_d, before_d, "disagg_kv_transfer_bytes_total") == 27 * 2048
    for name in ("disagg_kv_transfer_seconds_count", "disagg_bootstrap_wait_seconds_count", "disagg_prefill_compute_seconds_count"):
        assert delta(after_p, before_p, name) == 1
    assert delta(after_d, before_d, "disagg_kv_wait_seconds_count") == 1
    assert after_p["disagg_kv_transfer_seconds_sum"] > before_p.get("disagg_kv_transfer_seconds_sum", 0.0)


async def test_logprobs_of_every_token_cross_over_from_the_prefill(cluster, unified):
    # Chat's logprobs: a list of the top 3 per token (completions' are a dict keyed by the token's
    # text, where two ids decoding to one text share an entry, as in vLLM).
    body = {"model": "tiny", "messages": [{"role": "user", "content": SHORT}], "max_tokens": 4, "logprobs": True,
            "top_logprobs": 3, **GREEDY}
    pd = cluster.pd_body(body)
    _, (status, data, _) = await cluster.post_both("/v1/chat/completions", pd, pd)
    expected = (await unified_post(unified, "/v1/chat/completions", body))["choices"][0]["logprobs"]["content"]
    got = data["choices"][0]["logprobs"]["content"]
    assert status == 200
    assert [len(t["top_logprobs"]) for t in got] == [len(t["top_logprobs"]) for t in expected] == [3, 3, 3, 3]
    assert [t["token"] for t in got] == [t["token"] for t in expected]
    for ours, theirs in zip(got, expected):
        assert [t["token"] for t in ours["top_logprobs"]] == [t["token"] for t in theirs["top_logprobs"]]
        assert all(abs(a["logprob"] - b["logprob"]) < 1e-4 for a, b in zip(ours["top_logprobs"], theirs["top_logprobs"]))


async def test_min_tokens_and_seeded_sampling_pd_equal_unified(cluster, unified):
    """The prefill's first token obeys min_tokens; the decode's seeded generator skips the draw
    the prefill made, so both continue the one stream a single engine would sample."""
    probe = {"text": LONG, "sampling_params": {"max_new_tokens": 1, **GREEDY}}
    first = (await unified_post(unified, "/generate", probe))["output_ids"][0]
    bodies = [
        {"text": LONG, "sampling_params": {"max_new_tokens": 8, "min_new_tokens": 1, "stop_token_ids": [first], **GREEDY}},
        {"text": LONG, "sampling_params": {"max_new_tokens": 12, "temperature": 0.9, "top_p": 0.95,
                                           "sampling_seed": 77, "ignore_eos": True}},
    ]
    outputs = []
    for body in bodies:
        expected = (await unified_post(unified, "/generate", body))["output_ids"]
        pd = cluster.pd_body(body)
        (_, _, _), (d_status, d_data, _) = await cluster.post_both("/generate", pd, pd)
        assert d_status == 200, d_data
        assert d_data["output_ids"] == expected
        outputs.append(expected)
    assert outputs[0][0] != first and outputs[0][-1] == first and len(outputs[1]) == 12
