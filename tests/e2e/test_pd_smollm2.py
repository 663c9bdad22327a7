"""SmolLM2-135M disaggregated (nixl) equals SmolLM2-135M unified, token for token."""

import aiohttp
import pytest
import pytest_asyncio

from disagg.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pd_cluster import start_pd, start_unified

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(300)]
SMOLLM2 = EngineConfig(
    model=ModelConfig(dtype="float32"),
    cache=CacheConfig(kv_cache_memory_mib=64),
    scheduler=SchedulerConfig(max_num_batched_tokens=64),  # the long prompt is chunked
)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Write a short story about a robot learning to paint. " * 8]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def servers():
    cluster = await start_pd("nixl", engine=SMOLLM2)
    unified = await start_unified(SMOLLM2)
    yield cluster, unified
    await unified.close()
    await cluster.close()


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
