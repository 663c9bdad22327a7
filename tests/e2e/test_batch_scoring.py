"""Batches and scoring with real engine workers: greedy batches equal HF transformers and single
requests; prompt logprobs (echo, max_tokens 0, SGLang's input_* fields) equal HF's log_softmax;
P/D (with our router forwarding one room per prompt) equals unified."""

import json

import aiohttp
import pytest
import pytest_asyncio
import torch

from disagg.engine.models.tiny import build_tiny
from disagg.router.config import PrefillEndpoint, RouterConfig
from disagg.router.server import RouterServer
from pd_cluster import start_pd

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]
GREEDY = {"temperature": 0, "ignore_eos": True}
PROMPT_IDS = [[256, 72, 101, 108, 108, 111], [256, 84, 104, 101, 32, 113, 117, 105, 99, 107] * 2, [256, 48, 49]]


@pytest.fixture(scope="module")
def hf_tiny():
    from hf_reference import hf_model_from_loaded

    return hf_model_from_loaded(build_tiny(0), torch.float32)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster():
    c = await start_pd("tcp")
    yield c
    await c.close()


async def post(url: str, path: str, body: dict):
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        data = await r.json()
        assert r.status == 200, data
        return data


def unified_url(server) -> str:
    return f"http://127.0.0.1:{server.port}"


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def hf_prompt_logprobs(hf, ids: list[int]) -> list[float]:
    """log P(ids[i] | ids[:i]) for i >= 1."""
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [logprobs[i - 1, ids[i]].item() for i in range(1, len(ids))]


async def test_generate_batch_equals_hf_and_one_request_at_a_time(unified, hf_tiny):
    url = unified_url(unified)
    batch = await post(url, "/generate", {"input_ids": PROMPT_IDS, "sampling_params": {"max_new_tokens": 8, **GREEDY}})
    singles = [await post(url, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 8, **GREEDY}})
               for ids in PROMPT_IDS]
    expected = [hf_greedy(hf_tiny, ids, 8) for ids in PROMPT_IDS]
    assert len({tuple(e) for e in expected}) == 3
    assert [b["output_ids"] for b in batch] == [s["output_ids"] for s in singles] == expected


async def test_completions_batch_equals_hf(unified, hf_tiny):
    data = await post(unified_url(unified), "/v1/completions",
                      {"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": 6, "logprobs": 0, **GREEDY})
    tokenizer = build_tiny(0).tokenizer
    # Each logprob token is its id decoded alone (vLLM's rule): the HF greedy ids, decoded one by one.
    expected = [[tokenizer.decode([t], skip_special_tokens=False) for t in hf_greedy(hf_tiny, ids, 6)] for ids in PROMPT_IDS]
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    assert [c["logprobs"]["tokens"] for c in data["choices"]] == expected


async def test_echo_with_max_tokens_0_scores_the_prompt_as_hf(unified, hf_tiny):
    ids = PROMPT_IDS[1]
    data = await post(unified_url(unified), "/v1/completions",
                      {"model": "tiny", "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1})
    [choice] = data["choices"]
    assert (choice["text"], choice["finish_reason"], data["usage"]["completion_tokens"]) == (
        build_tiny(0).tokenizer.decode(ids, skip_special_tokens=False), "length", 0)
    logprobs = choice["logprobs"]
    tokens = [build_tiny(0).tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert logprobs["tokens"] == tokens and logprobs["token_logprobs"][0] is None
    torch.testing.assert_close(torch.tensor(logprobs["token_logprobs"][1:]), torch.tensor(hf_prompt_logprobs(hf_tiny, ids)),
                               atol=1e-4, rtol=0)


async def test_sglang_input_token_logprobs_equal_hf(unified, hf_tiny):
    ids = PROMPT_IDS[0]
    data = await post(unified_url(unified), "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 0},
                                                          "return_logprob": True, "logprob_start_len": 2,
                                                          "token_ids_logprob": [7, 300], "return_text_in_logprobs": True})
    meta = data["meta_info"]
    assert (data["output_ids"], meta["finish_reason"], meta["output_token_logprobs"]) == ([], {"type": "length", "length": 0}, [])
    decode = build_tiny(0).tokenizer.decode
    assert [(e[1], e[2]) for e in meta["input_token_logprobs"]] == [(t, decode([t], skip_special_tokens=False)) for t in ids[2:]]
    torch.testing.assert_close(torch.tensor([e[0] for e in meta["input_token_logprobs"]]),
                               torch.tensor(hf_prompt_logprobs(hf_tiny, ids)[1:]), atol=1e-4, rtol=0)
    with torch.no_grad():
        ref = torch.log_softmax(hf_tiny(torch.tensor([ids])).logits[0].float(), dim=-1)
    asked = meta["input_token_ids_logprobs"]
    assert [[e[1] for e in position] for position in asked] == [[7, 300]] * (len(ids) - 2)
    torch.testing.assert_close(torch.tensor([[e[0] for e in position] for position in asked]), ref[1:-1, [7, 300]],
                               atol=1e-4, rtol=0)


async def test_pd_echo_prompt_logprobs_cross_over_from_the_prefill(cluster, unified):
    body = {"model": "tiny", "prompt": PROMPT_IDS[1], "max_tokens": 3, "echo": True, "logprobs": 2, **GREEDY}
    pd = cluster.pd_body(body)
    _, (status, data, _) = await cluster.post_both("/v1/completions", pd, pd)
    expected = await post(unified_url(unified), "/v1/completions", body)
    assert status == 200, data
    got, want = data["choices"][0], expected["choices"][0]
    assert got["text"] == want["text"]
    assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
    assert got["logprobs"]["token_logprobs"][0] is None and len(got["logprobs"]["tokens"]) == len(PROMPT_IDS[1]) + 3
    torch.testing.assert_close(torch.tensor(got["logprobs"]["token_logprobs"][1:]),
                               torch.tensor(want["logprobs"]["token_logprobs"][1:]), atol=1e-5, rtol=0)
    assert [sorted(t) if t else t for t in got["logprobs"]["top_logprobs"]] == \
        [sorted(t) if t else t for t in want["logprobs"]["top_logprobs"]]


async def test_pd_batches_through_the_router_equal_unified(cluster, unified):
    config = RouterConfig(port=0, prefill=(PrefillEndpoint(cluster.prefill_url, cluster.prefill.bootstrap_port),),
                          decode=(cluster.decode_url,), health_check_interval_s=0)
    generate = {"input_ids": PROMPT_IDS, "sampling_params": [{"max_new_tokens": n, **GREEDY} for n in (4, 0, 6)],
                "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2, "token_ids_logprob": [7]}
    completions = {"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": 5, "echo": True, "logprobs": 1, **GREEDY}
    async with RouterServer(config) as router:
        pd_generate = await post(router.url, "/generate", generate)
        pd_completions = await post(router.url, "/v1/completions", completions)
    want_generate = await post(unified_url(unified), "/generate", generate)
    want_completions = await post(unified_url(unified), "/v1/completions", completions)
    assert [g["output_ids"] for g in pd_generate] == [g["output_ids"] for g in want_generate]
    assert [len(g["output_ids"]) for g in pd_generate] == [4, 0, 6]
    for ours, theirs in zip(pd_generate, want_generate):
        mine, want = ours["meta_info"], theirs["meta_info"]
        assert [e[1] for e in mine["input_token_logprobs"]] == [e[1] for e in want["input_token_logprobs"]]
        assert mine["input_token_logprobs"][0][0] is None
        torch.testing.assert_close(torch.tensor([e[0] for e in mine["input_token_logprobs"][1:]]),
                                   torch.tensor([e[0] for e in want["input_token_logprobs"][1:]]), atol=1e-5, rtol=0)
        for key in ("input_top_logprobs", "input_token_ids_logprobs", "output_token_ids_logprobs"):
            assert [[e[1] for e in top] if top else top for top in mine[key]] == \
                [[e[1] for e in top] if top else top for top in want[key]]
    assert [c["text"] for c in pd_completions["choices"]] == [c["text"] for c in want_completions["choices"]]
    assert [c["logprobs"]["tokens"] for c in pd_completions["choices"]] == \
        [c["logprobs"]["tokens"] for c in want_completions["choices"]]
    assert await cluster.free_blocks() == ([96, 96], [96, 96])


async def test_pd_streamed_batch_through_the_router_ends_as_unified(cluster, unified):
    config = RouterConfig(port=0, prefill=(PrefillEndpoint(cluster.prefill_url, cluster.prefill.bootstrap_port),),
                          decode=(cluster.decode_url,), health_check_interval_s=0)
    body = {"text": ["Once upon", "a time there"], "sampling_params": {"max_new_tokens": 5, **GREEDY}}
    async with RouterServer(config) as router, aiohttp.ClientSession() as s:
        async with s.post(router.url + "/generate", json=dict(body, stream=True)) as r:
            raw = await r.text()
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    last = {e["index"]: e["output_ids"] for e in events}
    want = await post(unified_url(unified), "/generate", body)
    assert raw.rstrip().endswith("data: [DONE]")
    assert [last[0], last[1]] == [w["output_ids"] for w in want] and all(len(ids) == 5 for ids in last.values())
