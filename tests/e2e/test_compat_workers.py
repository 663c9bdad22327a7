"""vLLM's /tokenize and /detokenize answered by real engine workers on the tiny model (exact ids),
and the vllm:* metrics of requests those workers served."""

import re

import aiohttp
import pytest
import pytest_asyncio

from disagg.config import ServerConfig
from disagg.pd_config import DisaggConfig
from disagg.launch import start_server
from pd_cluster import TINY

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

HI_THERE = [256, 72, 105, 32, 116, 104, 101, 114, 101]  # <bos> then one byte-level token per character
CHAT_HI = [256, 258, 117, 115, 101, 114, 10, 72, 105, 259, 10, 258, 97, 115, 115, 105, 115, 116, 97, 110, 116, 10]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server():
    running = await start_server(ServerConfig(port=0, dp_size=2, load_balance_method="round_robin"), TINY,
                                 DisaggConfig(), lambda _: None)
    yield running
    await running.close()


async def post(server, path: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{server.port}{path}", json=body) as r:
            return r.status, await r.json()


async def test_tokenize_a_prompt(server):
    max_model_len = server.controller.model.max_model_len
    assert await post(server, "/tokenize", {"prompt": "Hi there"}) == (
        200, {"count": 9, "max_model_len": max_model_len, "tokens": HI_THERE, "token_strs": None})
    assert await post(server, "/tokenize", {"prompt": "Hi there", "add_special_tokens": False,
                                            "return_token_strs": True}) == (
        200, {"count": 8, "max_model_len": max_model_len, "tokens": HI_THERE[1:],
              "token_strs": ["H", "i", "Ġ", "t", "h", "e", "r", "e"]})


async def test_tokenize_counts_what_generation_counts(server):
    status, body = await post(server, "/v1/completions", {"prompt": "Hi there", "max_tokens": 1})
    assert (status, body["usage"]["prompt_tokens"]) == (200, len(HI_THERE))
    status, body = await post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                               "max_tokens": 1})
    assert (status, body["usage"]["prompt_tokens"]) == (200, len(CHAT_HI))


async def test_tokenize_a_chat(server):
    messages = [{"role": "user", "content": "Hi"}]
    status, body = await post(server, "/tokenize", {"messages": messages})
    assert (status, body["tokens"], body["count"]) == (200, CHAT_HI, 22)
    continued = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    status, body = await post(server, "/tokenize", {"messages": continued, "continue_final_message": True})
    assert (status, body["tokens"]) == (200, CHAT_HI[:-1] + [10, 89, 111])  # ends right after "Yo"


async def test_detokenize_keeps_special_tokens(server):
    assert await post(server, "/detokenize", {"tokens": [256, 258, 72, 105, 259, 257]}) == (
        200, {"prompt": "<bos><|im_start|>Hi<|im_end|><eos>"})
    assert await post(server, "/detokenize", {"tokens": HI_THERE[1:]}) == (200, {"prompt": "Hi there"})


async def vllm_samples(server) -> dict[str, float]:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{server.port}/metrics") as r:
            text = await r.text()
    return {name + labels: float(value) for name, labels, value in re.findall(r"^(vllm:\w+)(\{.*\}) (\S+)$", text, re.M)}


async def test_vllm_metrics_count_a_request_on_its_engine(server):
    before = await vllm_samples(server)
    status, _ = await post(server, "/v1/completions", {"prompt": "Hi there", "max_tokens": 3, "ignore_eos": True,
                                                       "routed_dp_rank": 1})
    after = await vllm_samples(server)
    one = '{engine="1",model_name="tiny"}'
    changed = {k: after[k] - before.get(k, 0.0) for k in after
               if k.endswith(one) or 'engine="1",finished_reason' in k}
    assert status == 200
    assert {k: v for k, v in changed.items() if "_bucket" not in k and "_sum" not in k and "created" not in k
            and "num_requests" not in k and "kv_cache" not in k  # the workers' twice-a-second reports
            and "prefix_cache" not in k and "iteration_tokens" not in k} == {
        "vllm:prompt_tokens_total" + one: 9, "vllm:generation_tokens_total" + one: 3,
        'vllm:request_success_total{engine="1",finished_reason="stop",model_name="tiny"}': 0,
        'vllm:request_success_total{engine="1",finished_reason="length",model_name="tiny"}': 1,
        'vllm:request_success_total{engine="1",finished_reason="abort",model_name="tiny"}': 0,
        "vllm:time_to_first_token_seconds_count" + one: 1, "vllm:inter_token_latency_seconds_count" + one: 2,
        "vllm:request_time_per_output_token_seconds_count" + one: 1, "vllm:e2e_request_latency_seconds_count" + one: 1,
        **{f"vllm:request_{phase}_time_seconds_count" + one: 1 for phase in ("queue", "prefill", "decode", "inference")},
        "vllm:request_prompt_tokens_count" + one: 1, "vllm:request_generation_tokens_count" + one: 1,
        "vllm:request_params_max_tokens_count" + one: 1, "vllm:num_preemptions_total" + one: 0,
        "vllm:request_num_preemptions_count" + one: 1, "vllm:request_params_n_count" + one: 1,
    }
