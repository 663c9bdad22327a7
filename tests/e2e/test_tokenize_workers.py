"""vLLM's /tokenize and /detokenize answered by real engine workers on the tiny model: exact ids."""

import aiohttp
import pytest
import pytest_asyncio

from disagg.config import DisaggConfig, ServerConfig
from disagg.serving import start_server
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
