"""Logits-processor fields (penalties, logit_bias, bad_words, allowed_token_ids) reach the engine
from every generate endpoint that has them upstream, and bad values are 400s naming the field."""

import json

import pytest
from fake_engine import FakeEngine, api_client, bad_request, sse_events

from disagg.api.tokens_routes import DEFAULT_MAX_TOKENS
from disagg.types import GrammarKind, SamplingParams, StructuredOutput

pytestmark = pytest.mark.timeout(30)
PROCESSORS = {"presence_penalty": 0.5, "frequency_penalty": -0.25, "repetition_penalty": 1.5,
              "logit_bias": {"7": 100, "9": -200}}
VLLM_ONLY = {"bad_words": ["foo bar"], "allowed_token_ids": [7, 9, 11]}
EXPECTED = dict(presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.5, logit_bias={7: 100.0, 9: -100.0})


@pytest.mark.parametrize("path, body, expected", [
    ("/v1/completions", {"prompt": "a", "max_tokens": 2, **PROCESSORS, **VLLM_ONLY},
     SamplingParams(max_tokens=2, **EXPECTED, bad_words=["foo bar"], allowed_token_ids=[7, 9, 11])),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_tokens": 2, **PROCESSORS, **VLLM_ONLY},
     SamplingParams(max_tokens=2, default_max_tokens=None, **EXPECTED, bad_words=["foo bar"], allowed_token_ids=[7, 9, 11])),
    ("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"max_tokens": 2, **PROCESSORS, **VLLM_ONLY}},
     SamplingParams(max_tokens=2, default_max_tokens=DEFAULT_MAX_TOKENS, **EXPECTED, bad_words=["foo bar"], allowed_token_ids=[7, 9, 11])),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 2, **PROCESSORS}},
     SamplingParams(max_tokens=2, default_max_tokens=128, **EXPECTED)),
])
async def test_processor_fields_reach_the_engine(path, body, expected):
    engine = FakeEngine()
    async with api_client(engine) as client:
        resp = await client.post(path, json=body)
        assert resp.status == 200, await resp.text()
    assert engine.requests[0][0].sampling == expected


@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/completions", {"prompt": "a", "repetition_penalty": 0}, "repetition_penalty",
     "repetition_penalty must be in (0, 2], got 0.0"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "frequency_penalty": -3}, "frequency_penalty",
     "frequency_penalty must be in [-2, 2], got -3.0"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"-1": 1}}, "logit_bias",
     "logit_bias must map non-negative token ids to finite numbers, got '-1': 1.0"),
    ("/generate", {"text": "a", "sampling_params": {"logit_bias": {"a": 1}}}, "logit_bias",
     "logit_bias keys must be token ids, got 'a'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "logit_bias": {"a": 1, "5": 2, "b": 3}},
     "logit_bias", "logit_bias keys must be token ids, got 'a', 'b'"),  # every bad key named, as vLLM does
    ("/v1/completions", {"prompt": "a", "logit_bias": {"-1": 1, "2": 1, "-3": 2}}, "logit_bias",
     "logit_bias must map non-negative token ids to finite numbers, got '-1': 1.0, '-3': 2.0"),
    ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"allowed_token_ids": []}}, "allowed_token_ids",
     "allowed_token_ids must be a non-empty list of non-negative integers"),
])
async def test_bad_processor_values_are_400(path, body, param, message):
    async with api_client(FakeEngine()) as client:
        resp = await client.post(path, json=body)
        got = await resp.json()
    assert resp.status == 400
    assert got == bad_request(message, param)


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
CHAT = {"messages": [{"role": "user", "content": "a"}], "max_tokens": 2}


@pytest.mark.parametrize("path, body, kind, spec, param", [
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}}, "json_schema", '{"type": "object"}',
     "response_format"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
     "json_schema", json.dumps(SCHEMA), "response_format"),
    ("/v1/completions", {"prompt": "a", "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
     "json_schema", json.dumps(SCHEMA), "response_format"),
    ("/v1/completions", {"prompt": "a", "structured_outputs": {"regex": "a+"}}, "regex", "a+", "structured_outputs"),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"choice": ["x", "y"]}}, "choice", '["x", "y"]', "structured_outputs"),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"json": SCHEMA}}, "json_schema", json.dumps(SCHEMA), "structured_outputs"),
    ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"structured_outputs": {"grammar": 'root ::= "a"'}}},
     "grammar", 'root ::= "a"', "structured_outputs"),
    ("/v1/completions", {"prompt": "a", "guided_json": SCHEMA}, "json_schema", json.dumps(SCHEMA), "structured_outputs"),
    ("/v1/chat/completions", {**CHAT, "guided_choice": ["x", "y"]}, "choice", '["x", "y"]', "structured_outputs"),
    ("/v1/completions", {"prompt": "a", "guided_regex": "a+"}, "regex", "a+", "structured_outputs"),
    ("/generate", {"text": "a", "sampling_params": {"json_schema": json.dumps(SCHEMA)}}, "json_schema", json.dumps(SCHEMA), "json_schema"),
    ("/generate", {"text": "a", "sampling_params": {"regex": "[0-9]+"}}, "regex", "[0-9]+", "regex"),
    ("/generate", {"text": "a", "sampling_params": {"ebnf": 'root ::= "x"'}}, "grammar", 'root ::= "x"', "ebnf"),
    # SGLang's OpenAI bodies carry the same three at the top level
    ("/v1/chat/completions", {**CHAT, "regex": "[0-9]+"}, "regex", "[0-9]+", "regex"),
    ("/v1/chat/completions", {**CHAT, "json_schema": json.dumps(SCHEMA)}, "json_schema", json.dumps(SCHEMA), "json_schema"),
    ("/v1/completions", {"prompt": "a", "ebnf": 'root ::= "x"'}, "grammar", 'root ::= "x"', "ebnf"),
])
async def test_structured_fields_reach_the_engine(path, body, kind, spec, param):
    engine = FakeEngine()
    async with api_client(engine) as client:
        resp = await client.post(path, json=body)
        assert resp.status == 200, await resp.text()
    sampling = engine.requests[0][0].sampling
    assert sampling.structured_output == StructuredOutput(GrammarKind(kind), spec, param)


@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/chat/completions", {**CHAT, "regex": "a", "response_format": {"type": "json_object"}}, "regex",
     "set regex or response_format / structured_outputs, not both"),
    ("/v1/completions", {"prompt": "a", "regex": "a", "ebnf": 'root ::= "a"'}, "ebnf",
     "Only one of regex, json_schema, or ebnf can be set."),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "structural_tag"}}, "response_format",
     "response_format type 'structural_tag' is not supported: use 'text', 'json_object' or 'json_schema'"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "response_format json_schema needs json_schema.schema (a JSON schema object)"),
    ("/v1/completions", {"prompt": "a", "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "You can only use one kind of constraints for structured outputs ('json', 'regex', 'choice', 'grammar' or 'json_object')."),
    ("/v1/completions", {"prompt": "a", "structured_outputs": {"structural_tag": "{}"}}, "structured_outputs",
     "structured_outputs.structural_tag is not supported"),
    ("/v1/completions", {"prompt": "a", "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs", "set one of response_format and structured_outputs, not both"),
    ("/v1/completions", {"prompt": "a", "guided_regex": "a", "structured_outputs": {"regex": "b"}}, "structured_outputs",
     "set structured_outputs or the guided_* fields, not both"),
    ("/generate", {"text": "a", "sampling_params": {"regex": "a", "ebnf": "root ::= \"a\""}}, "ebnf",
     "Only one of regex, json_schema, or ebnf can be set."),
])
async def test_bad_structured_fields_are_400(path, body, param, message):
    async with api_client(FakeEngine()) as client:
        resp = await client.post(path, json=body)
        got = await resp.json()
    assert resp.status == 400
    assert got == bad_request(message, param)


async def test_n_choices_on_every_endpoint_indexed_with_children_seeded_seed_plus_i():
    engine = FakeEngine()
    chat = {**CHAT, "n": 3, "seed": 10}
    async with api_client(engine) as client:
        resp = await client.post("/v1/chat/completions", json=chat)
        body = await resp.json()
        assert resp.status == 200 and resp.headers["X-Request-Id"] == body["id"]
        assert [c["index"] for c in body["choices"]] == [0, 1, 2]
        assert [c["message"]["content"] for c in body["choices"]] == [" w100 w101"] * 3
        assert body["usage"] == {"prompt_tokens": 1, "completion_tokens": 6, "total_tokens": 7,
                                 "prompt_tokens_details": {"cached_tokens": 0}}
        sent = [(m.request_id, m.sampling.seed, rank) for m, rank in engine.requests]
        assert sent == [(f"{i}_{body['id']}", 10 + i, 0) for i in range(3)]  # one worker: the prompt is shared
        resp = await client.post("/generate", json={"text": "a b", "sampling_params": {"max_new_tokens": 1, "n": 2}})
        listed = await resp.json()
        assert [(b["text"], b["meta_info"]["completion_tokens"]) for b in listed] == [(" w100", 1)] * 2
        resp = await client.post("/inference/v1/generate", json={"token_ids": [1], "sampling_params": {"max_tokens": 1, "n": 2}})
        assert [(c["index"], c["token_ids"]) for c in (await resp.json())["choices"]] == [(0, [100]), (1, [100])]


async def test_n_choices_stream_every_index_and_one_usage():
    async with api_client(FakeEngine()) as client:
        resp = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "n": 2, "stream": True,
                                                          "stream_options": {"include_usage": True}})
        events = sse_events(await resp.text())
    assert events[-1] == "[DONE]"
    texts = {0: "", 1: ""}
    for event in events[:-2]:
        for choice in event["choices"]:
            texts[choice["index"]] += choice["text"]
    assert texts == {0: " w100 w101", 1: " w100 w101"}
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 4
    assert len({e["id"] for e in events[:-1]}) == 1


async def test_n_on_a_pd_leg_forks_children_with_their_own_rooms_and_the_pull_flow_refuses_it():
    engine = FakeEngine()
    async with api_client(engine) as client:
        resp = await client.post("/generate", json={"text": "a", "sampling_params": {"n": 2}, "bootstrap_host": "h",
                                                    "bootstrap_port": 1, "bootstrap_room": 5})
        assert resp.status == 200 and len(await resp.json()) == 2
        pull = await client.post("/v1/completions", json={"prompt": "a", "n": 2, "kv_transfer_params": {
            "do_remote_decode": True}})
        got = await pull.json()
    parent = engine.requests[0][0].request_id.split("_", 1)[1]
    assert sorted((m.request_id, m.bootstrap_room) for m, _ in engine.requests) == [(f"0_{parent}", 5), (f"1_{parent}", 6)]
    assert pull.status == 400 and got["error"]["param"] == "n"


async def test_chat_template_kwargs_reach_the_worker():
    engine = FakeEngine()
    async with api_client(engine) as client:
        resp = await client.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": {"enable_thinking": False}})
        assert resp.status == 200
    assert engine.requests[0][0].chat_template_kwargs == {"enable_thinking": False}


async def test_chat_continue_final_message_and_add_generation_prompt_reach_the_worker():
    engine = FakeEngine()
    async with api_client(engine) as client:
        for extra in ({}, {"continue_final_message": True}, {"add_generation_prompt": False}):
            resp = await client.post("/v1/chat/completions", json={**CHAT, **extra})
            assert resp.status == 200
        resp = await client.post("/v1/chat/completions", json={**CHAT, "continue_final_message": True,
                                                                "add_generation_prompt": True})
        got = await resp.json()
    assert [(m.add_generation_prompt, m.continue_final_message) for m, _ in engine.requests] == [
        (True, False), (False, True), (False, False)]
    assert (resp.status, got["error"]["param"]) == (400, "continue_final_message")
