"""SGLang-native POST /generate over real HTTP against the fake engine."""

import pytest
from fake_engine import FakeEngine, api_client, bad_request, sse_events

from disagg.types import SamplingParams

pytestmark = pytest.mark.timeout(30)


async def post(client, body, **kw):
    resp = await client.post("/generate", json=body, **kw)
    ctype = resp.headers.get("Content-Type", "")
    return resp, (await resp.json() if ctype.startswith("application/json") else await resp.text())


def latency_checked(meta: dict) -> dict:
    assert 0 <= meta.pop("e2e_latency") < 5
    return meta


async def test_generate_text_exact_answer():
    engine = FakeEngine(dp_size=2)
    async with api_client(engine) as client:
        resp, body = await post(client, {"text": "the sky is", "sampling_params": {"max_new_tokens": 3}, "rid": "r-1"})
    assert (resp.status, resp.headers["X-data-parallel-rank"]) == (200, "0")
    assert body["text"] == " w100 w101 w102" and body["output_ids"] == [100, 101, 102]
    assert latency_checked(body["meta_info"]) == {
        "id": "r-1", "finish_reason": {"type": "length", "length": 3}, "prompt_tokens": 3, "completion_tokens": 3,
        "cached_tokens": 0, "dp_rank": 0,
    }


async def test_generate_sampling_params_and_ignored_router_fields():
    engine = FakeEngine(num_cached_tokens=2)
    body = {"input_ids": [3, 4, 5], "sampling_params": {
        "max_new_tokens": 2, "min_new_tokens": 1, "temperature": 0, "top_p": 0.8, "top_k": 5, "min_p": 0.05,
        "stop": "x", "stop_token_ids": [7], "ignore_eos": True, "skip_special_tokens": False, "no_stop_trim": True,
        "spaces_between_special_tokens": True, "sampling_seed": 11},
        "log_metrics": True, "return_hidden_states": False, "return_text_in_logprobs": True, "custom_logit_processor": None,
        "bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 12345, "modalities": []}
    async with api_client(engine) as client:
        resp, got = await post(client, body)
    assert resp.status == 200 and got["meta_info"]["cached_tokens"] == 2
    msg = engine.requests[0][0]
    assert msg.prompt_token_ids == [3, 4, 5] and msg.prompt is None
    assert (msg.bootstrap_host, msg.bootstrap_port, msg.bootstrap_room) == ("10.0.0.1", 8998, 12345)
    assert msg.sampling == SamplingParams(max_tokens=2, min_tokens=1, temperature=0.0, top_p=0.8, top_k=5, min_p=0.05,
                                       seed=11, stop=["x"], stop_token_ids=[7], ignore_eos=True,
                                       include_stop_str_in_output=True, skip_special_tokens=False,
                                       default_max_tokens=128)


async def test_generate_default_max_new_tokens_is_128_capped_by_the_context():
    engine = FakeEngine()
    async with api_client(engine) as client:
        await post(client, {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}})
        _, body = await post(client, {"input_ids": [1]})
    assert [(m.sampling.max_tokens, m.sampling.default_max_tokens) for m, _ in engine.requests] == [(1, 128), (None, 128)]
    # SGLang's default never trips the context rule: 128 is capped to the 63 tokens left of a 64-token context
    assert (len(body["output_ids"]), body["meta_info"]["finish_reason"]) == (63, {"type": "length", "length": 63})


@pytest.mark.parametrize("body, param, message", [
    ({"text": "a", "input_ids": [1]}, "text", "send exactly one of text and input_ids"),
    ({}, "text", "send exactly one of text and input_ids"),
    ({"text": ["a", ""]}, "text", "text must be a non-empty string or a list of them"),
    ({"text": []}, "text", "text is an empty list: send a prompt or a non-empty batch of prompts"),
    ({"input_ids": [[1], [2, "x"]]}, "input_ids", "input_ids must be a list of integer token ids"),
    ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params",
     "sampling_params has 1 entries for 2 prompts: send one per prompt"),
    ({"text": ["a", "b"], "rid": "x"}, "rid", "rid of a batch must be a list of strings, one per prompt"),
    ({"text": ["a", "b"], "rid": ["x", "x"]}, "rid", "request id 'x' appears twice in the batch"),
    ({"text": ["a", "b"], "bootstrap_room": 5}, "bootstrap_room",
     "a batch of 2 prompts needs bootstrap_room as a list of 2 rooms"),
    ({"text": "a", "bootstrap_room": [5, 6]}, "bootstrap_room", "bootstrap_room has 2 entries for 1 prompts: send one per prompt"),
    ({"input_ids": [5000]}, "input_ids", "token id 5000 in input_ids is out of vocabulary (vocab_size=1000)"),
    ({"text": "a", "rid": ["x", "y"]}, "rid", "rid must be a non-empty string"),
    ({"text": "a", "sampling_params": {"n": 0}}, "n", "n must be between 1 and 64, got 0"),
    ({"text": ["a", "b"], "sampling_params": {"n": 2}}, "n", "n > 1 in a batch is not supported: send one prompt per request"),
    ({"text": "a", "sampling_params": {"max_new_tokens": "x"}}, "sampling_params.max_new_tokens",
     "invalid request body: Expected `int | null`, got `str` - at `$.sampling_params.max_new_tokens`"),
])
async def test_generate_bad_input_is_400(body, param, message):
    async with api_client(FakeEngine()) as client:
        resp, got = await post(client, body)
    assert resp.status == 400
    assert got == bad_request(message, param)


async def test_generate_stream_is_cumulative_then_done():
    async with api_client(FakeEngine()) as client:
        resp, raw = await post(client, {"text": "a", "sampling_params": {"max_new_tokens": 3}, "stream": True, "rid": "s1"})
    assert resp.headers["Content-Type"] == "text/event-stream"
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    assert [(e["text"], e["output_ids"], e["meta_info"]["finish_reason"], e["meta_info"]["completion_tokens"])
            for e in events[:-1]] == [
        (" w100", [100], None, 1),
        (" w100 w101", [100, 101], None, 2),
        (" w100 w101 w102", [100, 101, 102], {"type": "length", "length": 3}, 3),
    ]
    assert {(e["meta_info"]["id"], e["meta_info"]["dp_rank"]) for e in events[:-1]} == {("s1", 0)}


@pytest.mark.parametrize("sampling, finish, text", [
    ({"stop_token_ids": [101]}, {"type": "stop", "matched": 101}, " w100"),
    ({"stop": ["w102"]}, {"type": "stop", "matched": "w102"}, " w100 w101 "),
])
async def test_generate_finish_reason_matched(sampling, finish, text):
    async with api_client(FakeEngine()) as client:
        _, body = await post(client, {"text": "a", "sampling_params": {"max_new_tokens": 5, **sampling}})
    assert (body["meta_info"]["finish_reason"], body["text"]) == (finish, text)


async def test_generate_logprobs():
    async with api_client(FakeEngine()) as client:
        _, body = await post(client, {"input_ids": [4, 5, 6], "sampling_params": {"max_new_tokens": 2},
                                      "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 1})
    meta = body["meta_info"]
    assert meta["output_token_logprobs"] == [[-0.5, 100, None], [-0.5, 101, None]]
    assert meta["output_top_logprobs"] == [[[-0.5, 100, None], [-1.5, 101, None]], [[-0.5, 101, None], [-1.5, 102, None]]]
    assert meta["input_token_logprobs"] == [[-1.0, 5, None], [-1.0, 6, None]]
    assert meta["input_top_logprobs"] == [[[-1.0, 5, None], [-2.0, 6, None]], [[-1.0, 6, None], [-2.0, 7, None]]]


async def test_generate_logprobs_default_is_output_only():
    engine = FakeEngine()
    async with api_client(engine) as client:
        _, body = await post(client, {"input_ids": [4, 5], "sampling_params": {"max_new_tokens": 1}, "return_logprob": True})
    assert engine.requests[0][0].sampling.prompt_logprobs is None
    assert body["meta_info"]["output_token_logprobs"] == [[-0.5, 100, None]]
    assert "input_token_logprobs" not in body["meta_info"] and "output_top_logprobs" not in body["meta_info"]
