"""SmolLM2-135M (float32) through HTTP: disaggregated (nixl) equals unified token for token, so does a
prefill TP 3 (its 3 KV heads one per rank) to a decode TP 1 (tcp), and the unified server's batches,
penalties, logit_bias and seeded n > 1 choices equal HF transformers."""

import aiohttp
import pytest
import pytest_asyncio
import torch

from disagg.engine_config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from disagg.types import SamplingParams
from hf_reference import hf_greedy_processed, hf_model_from_loaded, hf_sampled
from pd_cluster import start_pd, start_tp_pd, start_unified

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(300)]
SMOLLM2 = EngineConfig(
    model=ModelConfig(dtype="float32"),
    cache=CacheConfig(kv_cache_memory_mib=64),
    scheduler=SchedulerConfig(max_num_batched_tokens=64),  # the long prompt is chunked
)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Write a short story about a robot learning to paint. " * 8]


N = 12


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def smollm2_unified():
    unified = await start_unified(SMOLLM2)
    yield f"http://127.0.0.1:{unified.port}", unified
    await unified.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def servers(smollm2_unified):
    cluster = await start_pd("nixl", engine=SMOLLM2)
    yield cluster, smollm2_unified[1]
    await cluster.close()


async def test_smollm2_prefill_tp3_to_decode_tp1_equals_unified(smollm2_unified):
    url, _ = smollm2_unified
    cluster = await start_tp_pd("tcp", 3, 1, engine=SMOLLM2)
    try:
        for prompt in PROMPTS:
            body = {"text": prompt, "sampling_params": {"max_new_tokens": 24, "temperature": 0}}
            pd = cluster.pd_body(body)
            _, (status, data, _) = await cluster.post_both("/generate", pd, pd)
            assert status == 200, data
            assert data["output_ids"] == (await post(url + "/generate", body))["output_ids"], prompt
    finally:
        await cluster.close()


@pytest.fixture(scope="module")
def hf32(smollm2_loaded):
    return hf_model_from_loaded(smollm2_loaded, torch.float32)


async def post(url: str, body: dict) -> dict:
    async with aiohttp.ClientSession() as s:
        async with s.post(url, json=body) as r:
            assert r.status == 200, await r.text()
            return await r.json()


@pytest.mark.parametrize("prompt", PROMPTS, ids=["france", "code", "long"])
async def test_smollm2_pd_equals_unified(servers, prompt):
    cluster, unified = servers
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 24, "temperature": 0}}
    pd = cluster.pd_body(body)
    _, (status, data, _) = await cluster.post_both("/generate", pd, pd)
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{unified.port}/generate", json=body) as r:
            expected = await r.json()
    assert status == 200, data
    assert data["output_ids"] == expected["output_ids"] and len(expected["output_ids"]) > 0
    assert data["text"] == expected["text"]


async def test_smollm2_batches_on_completions_and_generate_equal_hf(smollm2_unified, smollm2_loaded, hf32):
    url, _ = smollm2_unified
    tok = smollm2_loaded.tokenizer
    texts = PROMPTS[:2] + [tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])]
    ids = [tok.encode(t) for t in texts]
    greedy = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
    expected = [hf_greedy_processed(hf32, p, greedy, N) for p in ids]
    assert len({tuple(e) for e in expected}) == 3
    completions = await post(url + "/v1/completions", {"model": "smollm2-135m", "prompt": texts,
                                                       "max_tokens": N, "temperature": 0, "ignore_eos": True})
    assert [c["index"] for c in completions["choices"]] == [0, 1, 2]
    assert [c["text"] for c in completions["choices"]] == [tok.decode(e) for e in expected]
    sampling = {"max_new_tokens": N, "temperature": 0, "ignore_eos": True}
    by_text = await post(url + "/generate", {"text": PROMPTS[:2], "sampling_params": sampling})
    by_ids = await post(url + "/generate", {"input_ids": ids, "sampling_params": sampling})
    assert [o["output_ids"] for o in by_text] == expected[:2]
    assert [o["output_ids"] for o in by_ids] == expected


PENALTY_CASES = [
    {"repetition_penalty": 1.8},
    {"frequency_penalty": 1.5},
    {"presence_penalty": 2.0},
    {"presence_penalty": -0.5, "frequency_penalty": 1.0, "repetition_penalty": 1.3},
]


async def test_smollm2_penalties_and_logit_bias_in_one_batch_equal_hf(smollm2_unified, smollm2_loaded, hf32):
    url, _ = smollm2_unified
    prompt = "List the days of the week: Monday, Tuesday,"
    ids = smollm2_loaded.tokenizer.encode(prompt)
    base = {"max_tokens": N, "temperature": 0, "ignore_eos": True}
    plain = hf_greedy_processed(hf32, ids, SamplingParams(**base), N)
    cases = PENALTY_CASES + [{"logit_bias": {str(plain[0]): -100.0, str(plain[1]): 8.0}}]
    expected = [hf_greedy_processed(hf32, ids, SamplingParams(**base, **case), N) for case in cases]
    assert all(e != plain for e in expected)  # every case changes SmolLM2's greedy output
    # One /generate batch, each item with its own sampling params: scheduled together.
    items = [{"max_new_tokens": N, "temperature": 0, "ignore_eos": True, **case} for case in cases]
    outputs = await post(url + "/generate", {"text": [prompt] * len(cases), "sampling_params": items})
    assert [o["output_ids"] for o in outputs] == expected


async def test_smollm2_n_choices_with_a_seed_equal_hf_sampling_seeded_seed_plus_i(smollm2_unified, smollm2_loaded, hf32):
    url, _ = smollm2_unified
    prompt = "Once upon a time"
    ids = smollm2_loaded.tokenizer.encode(prompt)
    body = {"model": "smollm2-135m", "prompt": prompt, "n": 3, "seed": 7, "temperature": 0.8, "max_tokens": N,
            "ignore_eos": True}
    data = await post(url + "/v1/completions", body)
    expected = [smollm2_loaded.tokenizer.decode(hf_sampled(hf32, ids, 7 + i, 0.8, N)) for i in range(3)]
    assert len(set(expected)) == 3
    assert [c["text"] for c in sorted(data["choices"], key=lambda c: c["index"])] == expected
