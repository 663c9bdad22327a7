"""vLLM's /tokenize and /detokenize against the in-process fake engine: shapes, defaults, errors."""

import pytest

from fake_engine import FakeEngine, api_client, bad_request

from disagg.wire.engine_msgs import TokenizeMsg

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]


async def call(client, path, body):
    resp = await client.post(path, json=body)
    return resp.status, await resp.json()



async def test_tokenize_a_prompt_with_vllms_fields_on_one_ready_worker():
    engine = FakeEngine(dp_size=2)
    engine.alive[0] = False  # the first ready worker answers
    async with api_client(engine) as client:
        plain = await call(client, "/tokenize", {"model": "fake-model", "prompt": "hello big world"})
        strs = await call(client, "/tokenize", {"prompt": "hi there", "add_special_tokens": False,
                                                "return_token_strs": True})
    assert plain == (200, {"count": 4, "max_model_len": 64, "tokens": [1, 15, 13, 15], "token_strs": None})
    assert strs == (200, {"count": 2, "max_model_len": 64, "tokens": [12, 15], "token_strs": ["hi", "there"]})
    assert engine.utility_calls == [
        ("tokenize", (TokenizeMsg(prompt="hello big world"),)),
        ("tokenize", (TokenizeMsg(prompt="hi there", add_special_tokens=False, return_token_strs=True),))]
    assert engine.utility_ranks == [[1], [1]]


async def test_tokenize_chat_defaults_as_vllm():
    engine = FakeEngine(dp_size=1)
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}, {"role": "assistant", "content": "ok"}]
    async with api_client(engine) as client:
        chat = await call(client, "/tokenize", {"messages": messages})
        cont = await call(client, "/tokenize", {"messages": messages, "continue_final_message": True,
                                                "add_special_tokens": True})
    assert chat == (200, {"count": 5, "max_model_len": 64, "tokens": [16, 12, 21, 12, 21], "token_strs": None})
    assert cont == (200, {"count": 5, "max_model_len": 64, "tokens": [1, 16, 12, 21, 12], "token_strs": None})
    flat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    assert [args[0] for _, args in engine.utility_calls] == [
        TokenizeMsg(messages=flat, add_special_tokens=False),
        TokenizeMsg(messages=flat, add_special_tokens=True, add_generation_prompt=False, continue_final_message=True)]


@pytest.mark.parametrize("body, message, param", [
    ({}, "send a prompt (a string) or messages", "prompt"),
    ({"prompt": 5}, "invalid request body: Expected `str | null`, got `int` - at `$.prompt`", "prompt"),
    ({"messages": []}, "messages must be a non-empty list of {role, content} objects", "messages"),
    ({"messages": [{"role": "user", "content": "a"}], "continue_final_message": True, "add_generation_prompt": True},
     "Cannot set both `continue_final_message` and `add_generation_prompt` to True.", "continue_final_message"),
])
async def test_tokenize_refuses_bad_bodies(body, message, param):
    engine = FakeEngine()
    async with api_client(engine) as client:
        assert await call(client, "/tokenize", body) == (400, bad_request(message, param))
    assert engine.utility_calls == []


async def test_tokenize_errors_from_the_worker_and_unknown_models():
    engine = FakeEngine(dp_size=1)
    engine.utility_results["tokenize"] = [{"error": "this model has no chat template; send a plain prompt instead",
                                           "error_param": "messages"}]
    async with api_client(engine) as client:
        refused = await call(client, "/tokenize", {"messages": [{"role": "user", "content": "a"}]})
        unknown = await call(client, "/tokenize", {"model": "other", "prompt": "a"})
    assert refused == (400, bad_request("this model has no chat template; send a plain prompt instead", "messages"))
    assert unknown[0] == 404 and unknown[1]["error"]["code"] == "model_not_found"


async def test_tokenize_without_a_ready_worker_is_503():
    engine = FakeEngine(dp_size=2)
    engine.alive = [False, False]
    async with api_client(engine) as client:
        status, body = await call(client, "/tokenize", {"prompt": "a"})
    assert (status, body["error"]["message"]) == (503, "no DP worker is ready to tokenize")


async def test_detokenize():
    engine = FakeEngine(dp_size=2)
    async with api_client(engine) as client:
        text = await call(client, "/detokenize", {"model": "fake-model", "tokens": [5, 7]})
        empty = await call(client, "/detokenize", {"tokens": []})
        missing = await call(client, "/detokenize", {})
        out = await call(client, "/detokenize", {"tokens": [5, 1000]})
    assert text == (200, {"prompt": " w5 w7"})
    assert empty == (200, {"prompt": ""})
    assert missing == (400, bad_request("tokens is required: a list of token ids", "tokens"))
    assert out == (400, bad_request("token id 1000 in tokens is out of vocabulary (vocab_size=1000)", "tokens"))
    assert engine.utility_calls == [("detokenize", ([5, 7],)), ("detokenize", ([],))]
    assert engine.utility_ranks == [[0], [0]]
