"""The bodies users sent that got 500s (or killed the only worker), against `disagg unified` with one
real engine worker: each is now a 400 with a clear message, or served; the worker stays alive."""

from __future__ import annotations

import aiohttp
import pytest
import pytest_asyncio

from disagg.config import ServerConfig
from disagg.pd_config import DisaggConfig
from disagg.engine_config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from disagg.launch import start_server
from disagg.types import SamplingParams
from disagg.wire.engine_msgs import GenerateMsg

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]
ENGINE = EngineConfig(
    model=ModelConfig(model="tiny", dtype="float32", max_model_len=64),
    cache=CacheConfig(num_blocks=64, block_size=4),
    scheduler=SchedulerConfig(max_num_batched_tokens=32),
)
SEED_RANGE = "an integer between -9223372036854775808 and 9223372036854775807 (64-bit signed)"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server():
    running = await start_server(ServerConfig(port=0, dp_size=1), ENGINE, DisaggConfig(), lambda _: None)
    running.url = f"http://127.0.0.1:{running.port}"
    async with aiohttp.ClientSession() as session:
        running.session = session
        yield running
    await running.close()


async def post(server, path: str, body: dict | None = None, data: bytes | None = None):
    async with server.session.post(server.url + path, json=body, data=data) as resp:
        return resp.status, await resp.json()


def error(message: str, param: str | None) -> dict:
    return {"error": {"message": message, "type": "BadRequestError", "param": param, "code": None}}


async def assert_alive(server) -> None:
    async with server.session.get(server.url + "/health") as resp:
        assert resp.status == 200
    status, body = await post(server, "/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3}})
    assert (status, len(body["output_ids"])) == (200, 3)


@pytest.mark.parametrize("path, body, param, message", [
    ("/generate", {"input_ids": [5, 6, 7], "sampling_params": {"min_new_tokens": 2, "stop_token_ids": [999999999]}},
     "stop_token_ids", "stop token id 999999999 is out of vocabulary (vocab_size=320)"),
    ("/generate", {"input_ids": [5, 6, 7], "sampling_params": {"sampling_seed": 2**70}}, "seed",
     f"seed must be {SEED_RANGE}, got {2**70}"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**64}, "seed", f"seed must be {SEED_RANGE}, got {2**64}"),
    ("/inference/v1/generate", {"token_ids": [5], "sampling_params": {"seed": -(2**63) - 1}}, "seed",
     f"seed must be {SEED_RANGE}, got {-(2**63) - 1}"),
    ("/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2**62}}, "max_tokens",
     f"This model's maximum context length is 64 tokens. However, you requested {3 + 2**62} tokens (3 in the "
     f"messages, {2**62} in the completion). Please reduce the length of the messages or completion."),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 60}, "max_tokens",
     "This model's maximum context length is 64 tokens. However, you requested 82 tokens (22 in the messages, 60 in "
     "the completion). Please reduce the length of the messages or completion."),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type",
     "messages[0].content[0].type 'image_url' is not supported: this model takes text only (content parts of type 'text')"),
])
async def test_bodies_that_were_500s_are_400s_naming_the_field(server, path, body, param, message):
    assert await post(server, path, body) == (400, error(message, param))
    await assert_alive(server)


async def test_json_nested_100000_deep_is_400(server):
    deep = b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert await post(server, "/generate", data=deep) == (400, error("malformed JSON body: it is nested too deeply", None))
    await assert_alive(server)


async def test_a_tiny_temperature_is_greedy(server):
    outputs = []
    for temperature in (0, 1e-38):
        status, body = await post(server, "/generate", {"input_ids": [5, 6, 7], "sampling_params": {
            "max_new_tokens": 6, "temperature": temperature, "ignore_eos": True}})
        outputs.append((status, body["output_ids"]))
    assert outputs[0] == outputs[1] and len(outputs[0][1]) == 6


async def test_chat_content_parts_are_served_like_the_joined_string(server):
    joined = {"messages": [{"role": "user", "content": "Hello\nworld"}], "max_tokens": 5, "temperature": 0}
    parts = {**joined, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]}]}
    (status, first), (status2, second) = [await post(server, "/v1/chat/completions", body) for body in (joined, parts)]
    assert (status, status2) == (200, 200)
    assert second["choices"][0]["message"] == first["choices"][0]["message"]
    # The same 31 prompt tokens: the second request finds its 7 full blocks (of 4 tokens) in the prefix cache.
    assert (first["usage"]["prompt_tokens"], second["usage"]["prompt_tokens"]) == (31, 31)
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 28}
    await assert_alive(server)


async def test_chat_without_max_tokens_fills_the_rest_of_the_context(server):
    status, body = await post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "ignore_eos": True})
    assert (status, body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]) == (200, 22, 42)  # 22 + 42 = 64
    assert body["choices"][0]["finish_reason"] == "length"


async def test_the_only_worker_survives_a_request_that_raises_while_it_is_admitted(server):
    # The front now flattens content parts; a message that still reaches the worker unflattened (an older
    # front, another client of the worker protocol) makes the chat template raise TypeError in the worker.
    msg = GenerateMsg("raw-parts", SamplingParams(max_tokens=2), messages=[{"role": "user", "content": [{"type": "text"}]}])
    outputs = [out async for out in server.controller.generate(msg, 0)]
    assert [(o.error_status, o.error) for o in outputs] == [
        (500, 'the worker could not admit the request: TypeError: can only concatenate str (not "list") to str')]
    await assert_alive(server)
    async with server.session.get(server.url + "/server_info") as resp:
        [state] = (await resp.json())["internal_states"]
    assert (state["alive"], state["ready"]) == (True, True)
