"""Batched /generate (SGLang's shapes) over real HTTP against the fake engine."""

import pytest
from fake_engine import FakeEngine, api_client, sse_events

pytestmark = pytest.mark.timeout(30)


async def post(client, path, body):
    resp = await client.post(path, json=body)
    ctype = resp.headers.get("Content-Type", "")
    return resp, (await resp.json() if ctype.startswith("application/json") else await resp.text())


def strip_latency(items: list[dict]) -> list[dict]:
    for item in items:
        assert 0 <= item["meta_info"].pop("e2e_latency") < 5
    return items


async def test_generate_text_batch_is_a_list_with_per_prompt_sampling_and_rids():
    engine = FakeEngine(dp_size=2)
    body = {"text": ["one two", "three"], "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 1}],
            "rid": ["a", "b"]}
    async with api_client(engine) as client:
        resp, got = await post(client, "/generate", body)
    assert resp.status == 200
    assert strip_latency(got) == [
        {"text": " w100 w101", "output_ids": [100, 101], "meta_info": {
            "id": "a", "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 2, "completion_tokens": 2,
            "cached_tokens": 0, "dp_rank": 0}},
        {"text": " w100", "output_ids": [100], "meta_info": {
            "id": "b", "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": 1, "completion_tokens": 1,
            "cached_tokens": 0, "dp_rank": 1}},
    ]
    assert [(m.request_id, m.prompt, r) for m, r in engine.requests] == [("a", "one two", 0), ("b", "three", 1)]


async def test_generate_input_ids_batch_shares_one_sampling_dict_and_gets_one_room_each():
    engine = FakeEngine(dp_size=2, load_balance_method="follow_bootstrap_room")
    body = {"input_ids": [[1, 2], [3], [4, 5, 6]], "sampling_params": {"max_new_tokens": 1},
            "bootstrap_host": ["h"] * 3, "bootstrap_port": [8998] * 3, "bootstrap_room": [10, 11, 12]}
    async with api_client(engine) as client:
        resp, got = await post(client, "/generate", body)
    assert resp.status == 200 and [g["output_ids"] for g in got] == [[100], [100], [100]]
    assert [(m.prompt_token_ids, m.sampling.max_tokens, m.bootstrap_host, m.bootstrap_port, m.bootstrap_room, r)
            for m, r in engine.requests] == [
        ([1, 2], 1, "h", 8998, 10, 0), ([3], 1, "h", 8998, 11, 1), ([4, 5, 6], 1, "h", 8998, 12, 0)]
    assert len({m.request_id for m, _ in engine.requests}) == 3


async def test_generate_batch_of_one_is_still_a_list():
    async with api_client(FakeEngine()) as client:
        _, got = await post(client, "/generate", {"text": ["x"], "sampling_params": {"max_new_tokens": 1}})
    assert isinstance(got, list) and [g["text"] for g in got] == [" w100"]


async def test_generate_batch_streams_cumulative_events_with_their_index():
    async with api_client(FakeEngine()) as client:
        _, raw = await post(client, "/generate", {"text": ["a", "b"], "stream": True, "rid": ["x", "y"],
                                                  "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 1}]})
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    seen = sorted((e["index"], e["meta_info"]["id"], e["output_ids"]) for e in events[:-1])
    assert seen == [(0, "x", [100]), (0, "x", [100, 101]), (1, "y", [100])]


async def test_generate_batch_logprob_fields_per_prompt():
    engine = FakeEngine()
    body = {"input_ids": [[4, 5, 6], [7, 8]], "sampling_params": {"max_new_tokens": 1},
            "return_logprob": [True, False], "logprob_start_len": [1, -1], "top_logprobs_num": 1}
    async with api_client(engine) as client:
        _, got = await post(client, "/generate", body)
    assert [m.sampling.prompt_logprobs for m, _ in engine.requests] == [1, None]
    assert got[0]["meta_info"]["input_token_logprobs"] == [[-1.0, 5, None], [-1.0, 6, None]]
    assert got[0]["meta_info"]["output_token_logprobs"] == [[-0.5, 100, None]]
    assert "input_token_logprobs" not in got[1]["meta_info"] and "output_token_logprobs" not in got[1]["meta_info"]


async def test_generate_max_new_tokens_0_scores_the_prompt_only():
    async with api_client(FakeEngine()) as client:
        _, got = await post(client, "/generate", {"input_ids": [4, 5], "sampling_params": {"max_new_tokens": 0},
                                                  "return_logprob": True, "logprob_start_len": 0})
    assert (got["text"], got["output_ids"], got["meta_info"]["finish_reason"]) == ("", [], {"type": "length", "length": 0})
    assert got["meta_info"]["input_token_logprobs"] == [[None, 4, None], [-1.0, 5, None]]
    assert got["meta_info"]["output_token_logprobs"] == []


@pytest.mark.parametrize("stream", [False, True])
async def test_a_failing_item_fails_the_batch_and_aborts_the_others(stream):
    engine = FakeEngine(token_delay_s=0.01)
    body = {"input_ids": [[1] * 64, [2]], "rid": ["bad", "good"], "stream": stream,
            "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 50}]}
    async with api_client(engine) as client:
        resp, got = await post(client, "/generate", body)
    assert resp.status == 400
    assert got == {"error": {"message": "the prompt has 64 tokens; the context length is 64", "type": "BadRequestError",
                             "param": "prompt", "code": None}}
    assert engine.aborted == ["good"]


async def test_an_item_failing_mid_stream_ends_the_batch_stream_with_one_error_event():
    engine = FakeEngine()
    engine.script.error_after = 2
    body = {"text": ["a", "b"], "stream": True, "sampling_params": [{"max_new_tokens": 5}, {"max_new_tokens": 1}]}
    async with api_client(engine) as client:
        resp, raw = await post(client, "/generate", body)
    events = sse_events(raw)
    assert resp.status == 200 and events[-1] == "[DONE]"
    assert events[-2] == {"error": {"message": "worker failed", "type": "InternalServerError", "param": None, "code": None}}
    assert sorted((e["index"], e["output_ids"]) for e in events[:-2]) == [(0, [100]), (0, [100, 101]), (1, [100])]


def strip_created(body: dict) -> dict:
    assert isinstance(body.pop("created"), int)
    return body


async def test_completions_prompt_list_is_one_choice_per_prompt_with_summed_usage():
    engine = FakeEngine(dp_size=2)
    async with api_client(engine) as client:
        resp, got = await post(client, "/v1/completions", {"prompt": ["a b", [5, 6, 7]], "max_tokens": 2,
                                                           "request_id": "batch-1"})
    assert resp.status == 200 and resp.headers["X-Request-Id"] == "batch-1"
    assert strip_created(got) == {
        "id": "batch-1", "object": "text_completion", "model": "fake-model", "dp_rank": 0,
        "choices": [
            {"index": 0, "text": " w100 w101", "logprobs": None, "finish_reason": "length", "stop_reason": None,
             "prompt_logprobs": None},
            {"index": 1, "text": " w100 w101", "logprobs": None, "finish_reason": "length", "stop_reason": None,
             "prompt_logprobs": None}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9, "prompt_tokens_details": {"cached_tokens": 0}},
    }
    assert [(m.request_id, m.prompt, m.prompt_token_ids, r) for m, r in engine.requests] == [
        ("batch-1-0", "a b", None, 0), ("batch-1-1", None, [5, 6, 7], 1)]


async def test_completions_prompt_list_streams_chunks_with_their_choice_index_then_usage():
    async with api_client(FakeEngine()) as client:
        _, raw = await post(client, "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2, "stream": True,
                                                        "stream_options": {"include_usage": True}})
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [(c["index"], c["text"], c["finish_reason"]) for e in events[:-2] for c in e["choices"]]
    assert sorted(chunks) == [(0, " w100", None), (0, " w101", "length"), (1, " w100", None), (1, " w101", "length")]
    assert len({e["id"] for e in events[:-1]}) == 1
    assert (events[-2]["choices"], events[-2]["usage"]["completion_tokens"]) == ([], 4)


async def test_completions_echo_with_logprobs_returns_the_prompt_and_its_logprobs():
    engine = FakeEngine()
    async with api_client(engine) as client:
        _, got = await post(client, "/v1/completions", {"prompt": [4, 5], "max_tokens": 1, "echo": True, "logprobs": 1})
    [msg] = [m for m, _ in engine.requests]
    assert (msg.return_prompt, msg.sampling.logprobs, msg.sampling.prompt_logprobs) == (True, 1, 1)
    [choice] = got["choices"]
    assert choice["text"] == "<4> <5> w100"
    assert choice["logprobs"] == {
        # The fake worker's token texts; offsets as vLLM's: the prompt's cumulative from 0, the
        # answer's from the end of the echoed prompt text.
        "tokens": [" w4", " w5", " w100"],
        "token_logprobs": [None, -1.0, -0.5],
        "top_logprobs": [None, {" w5": -1.0}, {" w100": -0.5}],
        "text_offset": [0, 3, 7],
    }


async def test_completions_echo_of_a_text_prompt_with_max_tokens_0_is_the_prompt_alone():
    async with api_client(FakeEngine()) as client:
        _, got = await post(client, "/v1/completions", {"prompt": "score this", "max_tokens": 0, "echo": True})
        _, raw = await post(client, "/v1/completions", {"prompt": "score this", "max_tokens": 0, "echo": True,
                                                         "stream": True})
    assert [(c["text"], c["finish_reason"], c["logprobs"]) for c in got["choices"]] == [("score this", "length", None)]
    assert got["usage"]["completion_tokens"] == 0
    assert [c["text"] for e in sse_events(raw)[:-1] for c in e["choices"]] == ["score this"]


async def test_generate_token_ids_logprob_and_text_in_logprobs_in_sglangs_shapes():
    engine = FakeEngine()
    body = {"input_ids": [4, 5, 6], "sampling_params": {"max_new_tokens": 2}, "return_logprob": True,
            "logprob_start_len": 0, "top_logprobs_num": 1, "token_ids_logprob": [9, 3], "return_text_in_logprobs": True}
    async with api_client(engine) as client:
        _, got = await post(client, "/generate", body)
    [(msg, _)] = engine.requests
    assert (msg.sampling.logprob_token_ids, msg.return_prompt, msg.return_token_texts) == ((9, 3), True, True)
    meta = got["meta_info"]
    assert meta["input_token_logprobs"] == [[None, 4, " w4"], [-1.0, 5, " w5"], [-1.0, 6, " w6"]]
    assert meta["input_top_logprobs"] == [None, [[-1.0, 5, " w5"]], [[-1.0, 6, " w6"]]]
    assert meta["input_token_ids_logprobs"] == [None, [[-9.0, 9, " w9"], [-9.0, 3, " w3"]],
                                                [[-9.0, 9, " w9"], [-9.0, 3, " w3"]]]
    assert meta["output_token_logprobs"] == [[-0.5, 100, " w100"], [-0.5, 101, " w101"]]
    assert meta["output_top_logprobs"] == [[[-0.5, 100, " w100"]], [[-0.5, 101, " w101"]]]
    assert meta["output_token_ids_logprobs"] == [[[-9.0, 9, " w9"], [-9.0, 3, " w3"]]] * 2


async def test_generate_batch_token_ids_logprob_per_prompt():
    engine = FakeEngine()
    body = {"input_ids": [[4], [5]], "sampling_params": {"max_new_tokens": 1}, "return_logprob": True,
            "token_ids_logprob": [[7], [8, 9]]}
    async with api_client(engine) as client:
        _, got = await post(client, "/generate", body)
    assert [m.sampling.logprob_token_ids for m, _ in engine.requests] == [(7,), (8, 9)]
    assert [g["meta_info"]["output_token_ids_logprobs"] for g in got] == [
        [[[-9.0, 7, None]]], [[[-9.0, 8, None], [-9.0, 9, None]]]]


async def test_a_gateway_list_of_one_room_for_one_prompt_is_unwrapped():
    """sgl-model-gateway sends bootstrap lists whenever `prompt` is an array, even of one prompt."""
    engine = FakeEngine()
    async with api_client(engine) as client:
        _, got = await post(client, "/v1/completions", {"prompt": ["a"], "max_tokens": 1, "bootstrap_host": ["h"],
                                                        "bootstrap_port": [8998], "bootstrap_room": [5]})
    assert [c["index"] for c in got["choices"]] == [0]
    assert [(m.bootstrap_host, m.bootstrap_port, m.bootstrap_room) for m, _ in engine.requests] == [("h", 8998, 5)]
