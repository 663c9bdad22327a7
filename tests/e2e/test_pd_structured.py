"""Structured output, logits processors and n choices through real HTTP on real engine workers:
outputs parse against their schema, and P/D (tcp; push and pull flows) equals unified token for token."""

import json
import re

import aiohttp
import jsonschema
import pytest
import pytest_asyncio
from pd_cluster import start_pd

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
FLAGS = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
         "required": ["ok", "color"], "additionalProperties": False}
LONG = "The quick brown fox jumps over the lazy dog, twice: " * 2  # chunked prefill on the tiny config


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster():
    c = await start_pd("tcp")
    yield c
    await c.close()


async def post(port, path, body):
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{port}{path}", json=body) as r:
            return r.status, await r.json()


def requests_for(prompt: str) -> list[tuple[str, dict, object]]:
    """(path, body, check) triples; `check(text)` raises when the text breaks its constraint."""
    chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 80, "temperature": 0}
    return [
        ("/v1/chat/completions", {**chat, "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}},
         lambda t: jsonschema.validate(json.loads(t), PERSON)),
        ("/v1/completions", {"prompt": prompt, "max_tokens": 80, "temperature": 0, "structured_outputs": {"json": FLAGS}},
         lambda t: jsonschema.validate(json.loads(t), FLAGS)),
        ("/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 80, "temperature": 0, "json_schema": json.dumps(PERSON)}},
         lambda t: jsonschema.validate(json.loads(t), PERSON)),
        ("/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 40, "temperature": 0.8, "sampling_seed": 5,
                                                           "regex": r"[a-z]{3}-\d{2}"}},
         lambda t: re.fullmatch(r"[a-z]{3}-\d{2}", t) or pytest.fail(t)),
        # SGLang's constraints at the top of its OpenAI bodies (chat and completions): honoured, never dropped.
        ("/v1/chat/completions", {**chat, "temperature": 0.8, "seed": 3, "regex": r"(yes|no), [0-9]{2}"},
         lambda t: re.fullmatch(r"(yes|no), [0-9]{2}", t) or pytest.fail(t)),
        ("/v1/chat/completions", {**chat, "json_schema": json.dumps(FLAGS)},
         lambda t: jsonschema.validate(json.loads(t), FLAGS)),
        ("/v1/completions", {"prompt": prompt, "max_tokens": 20, "temperature": 0, "ebnf": 'root ::= "a" ("b" | "c")+ "."'},
         lambda t: re.fullmatch(r"a[bc]+\.", t) or pytest.fail(t)),
        ("/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True,
                                                           "repetition_penalty": 1.5, "frequency_penalty": 0.5,
                                                           "logit_bias": {"101": 4.0}}},
         lambda t: None),
    ]


def text_of(path: str, data: dict) -> str:
    if path == "/generate":
        return data["text"]
    choice = data["choices"][0]
    return choice["text"] if path == "/v1/completions" else choice["message"]["content"]


@pytest.mark.parametrize("prompt", ["hi", LONG], ids=["short", "long"])
async def test_structured_outputs_parse_and_pd_equals_unified(cluster, unified, prompt):
    for path, body, check in requests_for(prompt):
        status, data = await post(unified.port, path, body)
        assert status == 200, data
        expected = text_of(path, data)
        check(expected)
        pd = cluster.pd_body(body)
        (p_status, p_data, _), (d_status, d_data, _) = await cluster.post_both(path, pd, pd)
        assert (p_status, d_status) == (200, 200), (p_data, d_data)
        assert text_of(path, d_data) == expected, (path, body)


async def test_invalid_grammar_is_a_400_from_the_worker(unified):
    status, data = await post(unified.port, "/generate", {"text": "a", "sampling_params": {"regex": "("}})
    assert status == 400 and data["error"]["param"] == "regex"
    assert data["error"]["message"].startswith("invalid regex: ")
    status, data = await post(unified.port, "/v1/completions", {"prompt": "a", "logit_bias": {"100000": 1}})
    assert (status, data["error"]["param"]) == (400, "logit_bias")
    assert data["error"]["message"] == "token id 100000 in logit_bias is out of vocabulary (vocab_size=320)"
    status, data = await post(unified.port, "/v1/completions", {"prompt": "a", "logit_bias": {"100000": 1, "5": 1,
                                                                                             "100001": 2}})
    assert (status, data["error"]["message"]) == (
        400, "token ids 100000, 100001 in logit_bias are out of vocabulary (vocab_size=320)")  # each one, as vLLM


async def test_n_seeded_choices_equal_single_requests_seeded_seed_plus_i(unified):
    sampling = {"max_tokens": 10, "temperature": 1.0, "seed": 11, "ignore_eos": True}
    body = {"token_ids": list(LONG.encode()[:40]), "sampling_params": {**sampling, "n": 3}}
    status, data = await post(unified.port, "/inference/v1/generate", body)
    assert status == 200, data
    choices = [c["token_ids"] for c in data["choices"]]
    singles = []
    for i in range(3):
        single = {"token_ids": body["token_ids"], "sampling_params": {**sampling, "seed": 11 + i}}
        singles.append((await post(unified.port, "/inference/v1/generate", single))[1]["choices"][0]["token_ids"])
    assert choices == singles and len({tuple(c) for c in choices}) == 3
    assert [c["token_ids"] for c in (await post(unified.port, "/inference/v1/generate", body))[1]["choices"]] == choices
    assert data["usage"]["completion_tokens"] == 30 and data["usage"]["prompt_tokens"] == 40


async def test_n_structured_choices_stream_on_generate(unified):
    body = {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 80, "temperature": 0.7, "sampling_seed": 3,
                                                              "n": 2, "json_schema": json.dumps(FLAGS)}}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{unified.port}/generate", json=body) as r:
            raw = await r.text()
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
    last = {e["index"]: e["text"] for e in events}
    assert sorted(last) == [0, 1]
    for text in last.values():
        jsonschema.validate(json.loads(text), FLAGS)


async def test_n_children_share_the_prompt_through_the_prefix_cache(unified):
    prompt = "A prompt that no other test sends, long enough for several blocks."
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True, "n": 3}}
    status, listed = await post(unified.port, "/generate", body)
    assert status == 200, listed
    cached = [b["meta_info"]["cached_tokens"] for b in listed]
    num_prompt = listed[0]["meta_info"]["prompt_tokens"]
    assert cached == [0, num_prompt - 1 - (num_prompt - 1) % 4, num_prompt - 1 - (num_prompt - 1) % 4]
    assert len({tuple(b["output_ids"]) for b in listed}) == 1  # greedy: the same choice three times


async def test_pull_flow_structured_equals_unified(cluster, unified):
    """vLLM's pull flow: the prefill leg (one token) and the decode leg with its ticket."""
    pull = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
            "remote_host": None, "remote_port": None}
    for prompt in ("hi", LONG):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 80, "temperature": 0, "structured_outputs": {"json": PERSON}}
        status, data = await post(unified.port, "/v1/completions", body)
        assert status == 200, data
        expected = data["choices"][0]["text"]
        jsonschema.validate(json.loads(expected), PERSON)
        status, first, _ = await cluster.post(cluster.prefill_url + "/v1/completions",
                                              dict(body, max_tokens=1, min_tokens=1, kv_transfer_params=pull), None)
        assert status == 200, first
        status, data, _ = await cluster.post(cluster.decode_url + "/v1/completions",
                                             dict(body, kv_transfer_params=first["kv_transfer_params"]), None)
        assert status == 200, data
        assert data["choices"][0]["text"] == expected


async def test_chat_continue_final_message_continues_what_tokenize_shows(unified):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello th"}]
    chat = {"messages": messages, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "continue_final_message": True}
    status, data = await post(unified.port, "/v1/chat/completions", chat)
    assert status == 200, data
    status, tokens = await post(unified.port, "/tokenize", {"messages": messages, "continue_final_message": True})
    assert status == 200 and data["usage"]["prompt_tokens"] == tokens["count"]
    ids = tokens["tokens"]
    status, plain = await post(unified.port, "/v1/completions", {"prompt": ids, "max_tokens": 4, "temperature": 0,
                                                                 "ignore_eos": True})
    assert data["choices"][0]["message"]["content"] == plain["choices"][0]["text"]
