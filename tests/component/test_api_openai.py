"""/v1/completions, /v1/chat/completions and /v1/models over real HTTP against the fake engine."""

import re

import openai
import pytest
from fake_engine import FakeEngine, api_client, bad_request, sse_events

from disagg.types import SamplingParams

pytestmark = pytest.mark.timeout(30)
USAGE_2_3 = {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5, "prompt_tokens_details": {"cached_tokens": 0}}


def without_created(body: dict) -> dict:
    assert isinstance(body.pop("created"), int)
    return body


async def post(client, path, body, **kw):
    resp = await client.post(path, json=body, **kw)
    ctype = resp.headers.get("Content-Type", "")
    return resp, (await resp.json() if ctype.startswith("application/json") else await resp.text())


async def test_completion_non_stream_exact_body_and_headers():
    engine = FakeEngine(dp_size=2)
    async with api_client(engine) as client:
        resp, body = await post(client, "/v1/completions", {"model": "fake-model", "prompt": "hello world", "max_tokens": 3})
    assert resp.status == 200
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", body["id"])
    assert resp.headers["X-data-parallel-rank"] == "0"
    assert resp.headers["X-Request-Id"] == body["id"]
    assert without_created(body) == {
        "id": body["id"], "object": "text_completion", "model": "fake-model", "dp_rank": 0,
        "choices": [{"index": 0, "text": " w100 w101 w102", "logprobs": None, "finish_reason": "length", "stop_reason": None,
                     "prompt_logprobs": None}],
        "usage": USAGE_2_3, "kv_transfer_params": None,
    }
    msg, rank = engine.requests[0]
    assert (msg.prompt, msg.prompt_token_ids, msg.messages, rank) == ("hello world", None, None, 0)


async def test_completion_prompt_logprobs_in_vllms_shape_with_ranks():
    """Each prompt token from the second on: the token itself first, then the top-n ranked 1 to n (the
    fake engine makes each prompt token its own top-1, `id + k` the k-th next at -1 - k)."""
    async with api_client(FakeEngine()) as client:
        resp, body = await post(client, "/v1/completions", {"prompt": [5, 6, 9], "max_tokens": 1, "prompt_logprobs": 2})
    assert resp.status == 200
    assert body["choices"][0]["prompt_logprobs"] == [None] + [
        {str(t): {"logprob": -1.0, "rank": 1, "decoded_token": f" w{t}"},
         str(t + 1): {"logprob": -2.0, "rank": 2, "decoded_token": f" w{t + 1}"}} for t in (6, 9)]


async def test_completion_sampling_fields_reach_the_engine():
    engine = FakeEngine()
    body = {"prompt": [5, 6], "max_tokens": 4, "temperature": 0.5, "top_p": 0.9, "top_k": 7, "min_p": 0.1, "seed": 3,
            "stop": "zz", "stop_token_ids": [999], "ignore_eos": True, "min_tokens": 1, "logprobs": 2,
            "skip_special_tokens": False, "include_stop_str_in_output": True, "user": "ignored", "logit_bias": None}
    async with api_client(engine) as client:
        resp, _ = await post(client, "/v1/completions", body)
    assert resp.status == 200
    msg = engine.requests[0][0]
    assert msg.prompt_token_ids == [5, 6] and msg.add_special_tokens is True
    assert msg.sampling == SamplingParams(max_tokens=4, min_tokens=1, temperature=0.5, top_p=0.9, top_k=7, min_p=0.1, seed=3,
                                       stop=["zz"], stop_token_ids=[999], ignore_eos=True, include_stop_str_in_output=True,
                                       logprobs=2, skip_special_tokens=False, default_max_tokens=16)


@pytest.mark.parametrize("prompt, field, value", [
    (["one string"], "prompt", "one string"),
    ([[1, 2, 3]], "prompt_token_ids", [1, 2, 3]),
    ([7], "prompt_token_ids", [7]),
])
async def test_completion_prompt_forms(prompt, field, value):
    engine = FakeEngine()
    async with api_client(engine) as client:
        resp, _ = await post(client, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert resp.status == 200
    assert getattr(engine.requests[0][0], field) == value


@pytest.mark.parametrize("body, param, message", [
    ({"prompt": "a", "n": 65}, "n", "n must be between 1 and 64, got 65"),
    ({"prompt": ["a", "b"], "n": 2, "kv_transfer_params": {"do_remote_decode": True}}, "n",
     "n > 1 is not supported in the pull flow (kv_transfer_params): each choice needs its own ticket; send n "
     "requests, or use the push flow or a unified server"),
    ({"prompt": ["a", ""]}, "prompt", "prompt must not be empty"),
    ({"prompt": ["a", [1, "x"]]}, "prompt", "prompt must be a list of integer token ids"),
    ({"prompt": ["a", "b"], "bootstrap_room": 3}, "bootstrap_room",
     "a batch of 2 prompts needs bootstrap_room as a list of 2 rooms"),
    ({"prompt": ""}, "prompt", "prompt must not be empty"),
    ({}, "prompt", "prompt is required"),
    ({"prompt": [1, -2]}, "prompt", "token id -2 in prompt is negative"),
    ({"prompt": [1, 1000]}, "prompt", "token id 1000 in prompt is out of vocabulary (vocab_size=1000)"),
    ({"prompt": "a", "max_tokens": -1}, "max_tokens", "max_tokens must be at least 0, got -1"),
    ({"prompt": "a", "temperature": -1}, "temperature", "temperature must be non-negative, got -1.0"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options",
     "stream_options can only be set when stream is true"),
    ({"prompt": "a", "presence_penalty": 2.5}, "presence_penalty", "presence_penalty must be in [-2, 2], got 2.5"),
    ({"prompt": "a", "stream": True, "prompt_logprobs": 1}, "prompt_logprobs",
     "`prompt_logprobs` are not available when `stream=True`."),
    ({"prompt": "a", "stream": True, "prompt_logprobs": -1}, "prompt_logprobs",
     "`prompt_logprobs` are not available when `stream=True`."),
    ({"prompt": "a", "max_tokens": "abc"}, "max_tokens",
     "invalid request body: Expected `int | null`, got `str` - at `$.max_tokens`"),
])
async def test_completion_bad_input_is_400(body, param, message):
    async with api_client(FakeEngine()) as client:
        resp, got = await post(client, "/v1/completions", body)
    assert resp.status == 400
    assert got == bad_request(message, param)


async def test_unknown_model_is_404_model_not_found():
    async with api_client(FakeEngine()) as client:
        for path, body in (("/v1/completions", {"prompt": "a"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]})):
            resp, got = await post(client, path, {**body, "model": "gpt-9"})
            assert resp.status == 404
            assert got == {"error": {"message": "The model `gpt-9` does not exist.", "type": "NotFoundError",
                                     "param": "model", "code": "model_not_found"}}


async def test_completion_stream_events_with_continuous_usage():
    async with api_client(FakeEngine()) as client:
        resp, raw = await post(client, "/v1/completions", {
            "prompt": "a b", "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert resp.status == 200 and resp.headers["Content-Type"] == "text/event-stream"
    assert resp.headers["X-data-parallel-rank"] == "0"
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    rid = events[0]["id"]
    texts = [(e["choices"], e["usage"]["completion_tokens"], e["dp_rank"]) for e in events[:-1]]
    assert texts == [
        ([{"index": 0, "text": " w100", "logprobs": None, "finish_reason": None, "stop_reason": None}], 1, 0),
        ([{"index": 0, "text": " w101", "logprobs": None, "finish_reason": "length", "stop_reason": None}], 2, 0),
        ([], 2, 0),
    ]
    assert all(e["id"] == rid and e["object"] == "text_completion" for e in events[:-1])


async def test_completion_stream_without_usage_has_no_usage():
    async with api_client(FakeEngine()) as client:
        _, raw = await post(client, "/v1/completions", {"prompt": "a", "max_tokens": 2, "stream": True})
    events = sse_events(raw)
    assert [e["choices"][0]["text"] for e in events[:-1]] == [" w100", " w101"]
    assert all("usage" not in e for e in events[:-1]) and events[-1] == "[DONE]"


async def test_completion_logprobs_and_stop_string():
    async with api_client(FakeEngine()) as client:
        _, body = await post(client, "/v1/completions", {"prompt": "a", "max_tokens": 5, "logprobs": 1, "stop": ["w102"]})
    choice = body["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (" w100 w101 ", "stop", "w102")
    assert choice["logprobs"] == {
        # The worker's text of each token (the fake engine's " w<id>"), at vLLM's cumulative offsets.
        "tokens": [" w100", " w101", " w102"], "token_logprobs": [-0.5, -0.5, -0.5],
        "top_logprobs": [{" w100": -0.5}, {" w101": -0.5}, {" w102": -0.5}],
        "text_offset": [0, 5, 10],
    }


async def test_chat_non_stream_defaults_and_logprobs():
    engine = FakeEngine()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    async with api_client(engine) as client:
        resp, body = await post(client, "/v1/chat/completions", {
            "messages": messages, "max_completion_tokens": 2, "max_tokens": 9, "logprobs": True, "top_logprobs": 1})
    assert resp.status == 200 and re.fullmatch(r"chatcmpl-[0-9a-f]{32}", body["id"])
    assert without_created(body) == {
        "id": body["id"], "object": "chat.completion", "model": "fake-model", "dp_rank": 0,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": " w100 w101"}, "finish_reason": "length",
                     "stop_reason": None, "logprobs": {"content": [
                         {"token": f" w{t}", "logprob": -0.5, "bytes": list(f" w{t}".encode()),
                          "top_logprobs": [{"token": f" w{t}", "logprob": -0.5, "bytes": [32, 119, 49, 48, t - 52]}]}
                         for t in (100, 101)]}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5, "prompt_tokens_details": {"cached_tokens": 0}},
        "prompt_logprobs": None, "kv_transfer_params": None,
    }
    msg = engine.requests[0][0]
    assert (msg.messages, msg.sampling.max_tokens, msg.sampling.logprobs, msg.add_special_tokens) == (messages, 2, 1, False)


async def test_chat_max_tokens_defaults_to_the_rest_of_the_context():
    engine = FakeEngine()
    async with api_client(engine) as client:
        _, body = await post(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": None})
    sampling = engine.requests[0][0].sampling
    assert (sampling.max_tokens, sampling.default_max_tokens) == (None, None)  # unset: the worker fills the context
    assert (body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]) == (1, 63)  # 1 + 63 = the context, 64
    assert body["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("body, param, message", [
    ({"messages": []}, "messages", "messages must be a non-empty list of {role, content} objects"),
    ({"messages": [{"content": "x"}]}, "messages", "messages[0] must be an object with a string 'role'"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs",
     "top_logprobs requires logprobs to be true"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n", "n must be between 1 and 64, got 0"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": True, "prompt_logprobs": 2}, "prompt_logprobs",
     "`prompt_logprobs` are not available when `stream=True`."),
])
async def test_chat_bad_input_is_400(body, param, message):
    async with api_client(FakeEngine()) as client:
        resp, got = await post(client, "/v1/chat/completions", body)
    assert (resp.status, got["error"]["param"], got["error"]["message"]) == (400, param, message)


async def test_chat_stream_raw_events():
    async with api_client(FakeEngine()) as client:
        _, raw = await post(client, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True,
            "stop_token_ids": [101]})
    events = sse_events(raw)
    assert [(e["object"], e["choices"][0]["delta"], e["choices"][0]["finish_reason"], e["choices"][0]["stop_reason"])
            for e in events[:-1]] == [
        ("chat.completion.chunk", {"role": "assistant", "content": ""}, None, None),
        ("chat.completion.chunk", {"content": " w100"}, None, None),
        ("chat.completion.chunk", {"content": ""}, "stop", 101),  # the stop token: no text
    ]
    assert events[-1] == "[DONE]"


async def test_chat_continuous_usage_counts_no_token_in_the_role_chunk():
    """As vLLM: the role chunk goes out before any token (completion_tokens 0), each content chunk
    counts the tokens up to it, the usage chunk all of them."""
    async with api_client(FakeEngine()) as client:
        _, raw = await post(client, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    events = sse_events(raw)[:-1]
    assert [(e["choices"][0]["delta"] if e["choices"] else None, e["usage"]["completion_tokens"],
             e["usage"]["total_tokens"] - e["usage"]["prompt_tokens"]) for e in events] == [
        ({"role": "assistant", "content": ""}, 0, 0), ({"content": " w100"}, 1, 1), ({"content": " w101"}, 2, 2),
        (None, 2, 2)]


async def test_worker_rejection_keeps_its_status_even_when_streaming():
    async with api_client(FakeEngine()) as client:
        for stream in (False, True):
            resp, got = await post(client, "/v1/completions", {"prompt": "w " * 70, "stream": stream})
            assert (resp.status, resp.headers["Content-Type"]) == (400, "application/json")
            assert got["error"] == {"message": "the prompt has 70 tokens; the context length is 64",
                                    "type": "BadRequestError", "param": "prompt", "code": None}


async def test_mid_stream_failures_become_one_error_event_then_done():
    engine = FakeEngine()
    async with api_client(engine) as client:
        engine.script.error_after = 1
        _, raw = await post(client, "/v1/completions", {"prompt": "a", "max_tokens": 4, "stream": True})
        engine.script.error_after, engine.script.raise_after = None, 2
        _, raw2 = await post(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                                                              "max_tokens": 4, "stream": True})
    events = sse_events(raw)
    assert [e["choices"][0]["text"] for e in events[:1]] == [" w100"]
    assert events[1:] == [{"error": {"message": "worker failed", "type": "InternalServerError", "param": None, "code": None}},
                          "[DONE]"]
    events2 = sse_events(raw2)
    assert events2[-2:] == [{"error": {"message": "DP worker died mid-request", "type": "ServiceUnavailableError",
                                       "param": None, "code": None}}, "[DONE]"]
    assert len(events2) == 5  # role, w100, w101, error, [DONE]


async def test_models_list():
    async with api_client(FakeEngine()) as client:
        resp, body = await post(client, "/v1/completions", {"prompt": "a", "max_tokens": 1})
        resp = await client.get("/v1/models")
        body = await resp.json()
    assert resp.status == 200
    assert body["object"] == "list" and len(body["data"]) == 1
    card = body["data"][0]
    assert (card["id"], card["object"], card["owned_by"], card["max_model_len"]) == ("fake-model", "model", "disagg", 64)


async def test_models_retrieve_names_the_served_model_and_refuses_others():
    """The openai SDK's models.retrieve: GET /v1/models/{id}."""
    async with api_client(FakeEngine()) as client:
        listed = (await (await client.get("/v1/models")).json())["data"][0]
        one = await client.get("/v1/models/fake-model")
        assert (one.status, await one.json()) == (200, listed)
        other = await client.get("/v1/models/org/other-model")
        assert (other.status, (await other.json())["error"]) == (404, {
            "message": "The model `org/other-model` does not exist.", "type": "NotFoundError", "param": "model",
            "code": "model_not_found"})


async def test_openai_sdk_non_stream_and_streaming_chat():
    engine = FakeEngine()
    async with api_client(engine, api_key="sk-test") as client:
        sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="sk-test", max_retries=0)
        completion = await sdk.completions.create(model="fake-model", prompt="hi", max_tokens=2)
        assert (completion.choices[0].text, completion.usage.completion_tokens) == (" w100 w101", 2)
        stream = await sdk.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True,
            stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        await sdk.close()
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == " w100 w101 w102"
    assert [c.choices[0].finish_reason for c in chunks if c.choices] == [None, None, None, "length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    assert {c.model_extra["dp_rank"] for c in chunks} == {1}


async def test_openai_sdk_sees_typed_errors():
    async with api_client(FakeEngine(), api_key="sk-test") as client:
        sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="sk-test", max_retries=0)
        with pytest.raises(openai.NotFoundError) as not_found:
            await sdk.completions.create(model="nope", prompt="hi")
        with pytest.raises(openai.BadRequestError) as bad:
            await sdk.completions.create(model="fake-model", prompt="hi", n=100)
        wrong_key = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await wrong_key.models.list()
        await sdk.close()
        await wrong_key.close()
    assert not_found.value.code == "model_not_found"
    assert (bad.value.param, bad.value.status_code) == ("n", 400)
