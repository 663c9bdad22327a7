"""Tokens-in/tokens-out POST /inference/v1/generate over real HTTP against the fake engine."""

import pytest
from fake_engine import FakeEngine, api_client, sse_events

pytestmark = pytest.mark.timeout(30)
PATH = "/inference/v1/generate"


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": 0}}


async def post(client, body, **kw):
    resp = await client.post(PATH, json=body, **kw)
    ctype = resp.headers.get("Content-Type", "")
    return resp, (await resp.json() if ctype.startswith("application/json") else await resp.text())


async def test_tokens_non_stream_exact():
    engine = FakeEngine()
    async with api_client(engine) as client:
        resp, body = await post(client, {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2, "temperature": 0},
                                         "request_id": "t-1", "priority": 5, "model": "fake-model", "cache_salt": "s"})
    assert (resp.status, resp.headers["X-data-parallel-rank"], resp.headers["X-Request-Id"]) == (200, "0", "t-1")
    assert body == {"request_id": "t-1", "choices": [{"index": 0, "token_ids": [100, 101], "finish_reason": "length",
                                                      "stop_reason": None, "logprobs": None}],
                    "prompt_logprobs": None, "usage": usage(3, 2), "dp_rank": 0}
    assert engine.requests[0][0].prompt_token_ids == [1, 2, 3]


@pytest.mark.parametrize("body, status, param, message", [
    ({"token_ids": [1], "stream_options": {"include_usage": True}}, 400, "stream_options",
     "stream_options can only be set when stream is true"),
    ({"token_ids": []}, 400, "token_ids", "token_ids must be a non-empty list of token ids"),
    ({}, 400, "token_ids", "token_ids must be a non-empty list of token ids"),
    ({"token_ids": [1, -1]}, 400, "token_ids", "token id -1 in token_ids is negative"),
    ({"token_ids": [1000]}, 400, "token_ids", "token id 1000 in token_ids is out of vocabulary (vocab_size=1000)"),
    # vLLM's tokens endpoint generates: max_tokens 0 (the OpenAI endpoints' scoring) is refused as it refuses it.
    ({"token_ids": [1], "sampling_params": {"max_tokens": 0}}, 400, "sampling_params", "max_tokens must be greater than 0."),
    ({"token_ids": [1], "sampling_params": {"max_tokens": -1}}, 400, "sampling_params", "max_tokens must be greater than 0."),
    ({"token_ids": [1], "sampling_params": {"prompt_logprobs": -2}}, 400, "prompt_logprobs",
     "prompt_logprobs must be -1 (as many as the server allows) or non-negative, got -2"),
    ({"token_ids": [1], "model": "other"}, 404, "model", "The model `other` does not exist."),
    ({"token_ids": [1.5]}, 400, "token_ids", "invalid request body: Expected `int`, got `float` - at `$.token_ids[0]`"),
])
async def test_tokens_validation(body, status, param, message):
    engine = FakeEngine()
    async with api_client(engine) as client:
        resp, got = await post(client, body)
    assert (resp.status, got["error"]["param"], got["error"]["message"]) == (status, param, message)
    assert engine.requests == []


async def test_tokens_prompt_logprobs_all_means_the_cap():
    engine = FakeEngine()
    async with api_client(engine) as client:
        _, body = await post(client, {"token_ids": [4, 5], "sampling_params": {"max_tokens": 1, "prompt_logprobs": -1,
                                                                               "logprobs": 0}})
    assert engine.requests[0][0].sampling.prompt_logprobs == 20
    assert body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"][1]) == 20  # the prompt token is in its top-20
    assert body["prompt_logprobs"][1]["5"] == {"logprob": -1.0, "rank": 1}
    assert body["prompt_logprobs"][1]["6"] == {"logprob": -2.0, "rank": 2}
    assert body["choices"][0]["logprobs"] == {"content": [
        {"token": "token_id:100", "logprob": -0.5, "bytes": list(b"token_id:100"), "top_logprobs": []}]}


async def test_tokens_stream_only_new_ids_and_usage_chunks():
    async with api_client(FakeEngine()) as client:
        _, raw = await post(client, {"token_ids": [1, 2], "sampling_params": {"max_tokens": 3}, "stream": True,
                                     "request_id": "s", "stream_options": {"include_usage": True}})
        _, raw2 = await post(client, {"token_ids": [1, 2], "sampling_params": {"max_tokens": 2}, "stream": True,
                                      "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
        _, raw3 = await post(client, {"token_ids": [1, 2], "sampling_params": {"max_tokens": 1}, "stream": True})

    def choice(ids, finish):
        return [{"index": 0, "token_ids": ids, "finish_reason": finish, "stop_reason": None, "logprobs": None}]

    assert sse_events(raw) == [
        {"request_id": "s", "choices": choice([100], None), "dp_rank": 0},
        {"request_id": "s", "choices": choice([101], None), "dp_rank": 0},
        {"request_id": "s", "choices": choice([102], "length"), "dp_rank": 0},
        {"request_id": "s", "choices": [], "usage": usage(2, 3), "dp_rank": 0},
        "[DONE]",
    ]
    events2 = sse_events(raw2)
    assert [(e["choices"], e["usage"], e["dp_rank"]) for e in events2[:-1]] == [
        (choice([100], None), usage(2, 1), 1), (choice([101], "length"), usage(2, 2), 1), ([], usage(2, 2), 1)]
    events3 = sse_events(raw3)
    assert [e["choices"] for e in events3[:-1]] == [choice([100], "length")] and events3[-1] == "[DONE]"
    assert "usage" not in events3[0]


async def test_tokens_stream_finish_without_new_tokens_still_gets_a_chunk():
    engine = FakeEngine(token_delay_s=0.02)
    async with api_client(engine) as client:
        resp = await client.post(PATH, json={"token_ids": [1], "sampling_params": {"max_tokens": 60}, "stream": True,
                                             "request_id": "long"})
        first = await resp.content.readuntil(b"\n\n")
        abort = await client.post("/abort_requests", json={"rid": "long"})
        assert (abort.status, await abort.json()) == (200, {"aborted": ["long"]})
        events = sse_events(first.decode() + (await resp.text()))
    assert events[0]["choices"][0]["token_ids"] == [100]
    assert events[-2]["choices"] == [{"index": 0, "token_ids": [], "finish_reason": "abort", "stop_reason": None,
                                      "logprobs": None}]
    assert events[-1] == "[DONE]"


async def test_tokens_stream_engine_error_is_one_event():
    engine = FakeEngine()
    engine.script.error_after = 2
    engine.script.error_status = 503
    engine.script.error_text = "KV transfer failed"
    async with api_client(engine) as client:
        _, raw = await post(client, {"token_ids": [1], "sampling_params": {"max_tokens": 5}, "stream": True})
    events = sse_events(raw)
    assert [e["choices"][0]["token_ids"] for e in events[:2]] == [[100], [101]]
    assert events[2:] == [{"error": {"message": "KV transfer failed", "type": "ServiceUnavailableError", "param": None,
                                     "code": None}}, "[DONE]"]


async def test_tokens_non_stream_engine_error_keeps_status():
    engine = FakeEngine()
    engine.script.error_after, engine.script.error_status = 1, 503
    async with api_client(engine) as client:
        resp, got = await post(client, {"token_ids": [1], "sampling_params": {"max_tokens": 5}})
    assert (resp.status, got["error"]["message"]) == (503, "worker failed")
