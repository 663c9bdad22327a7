"""Bad input at the HTTP front is a 400 naming the field, never a 500: chat content parts, integers
past 64 bits, seeds, request ids, JSON nested too deeply. Real HTTP against the fake engine."""

import pytest
from fake_engine import FakeEngine, api_client, bad_request

pytestmark = pytest.mark.timeout(30)
DEEP = b"[" * 100_000 + b"]" * 100_000  # what a user sent; the decoder recursed until Python stopped it
GENERATE = {
    "/generate": {"text": "a", "sampling_params": {"max_new_tokens": 1}},
    "/v1/completions": {"prompt": "a", "max_tokens": 1},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "a"}], "max_tokens": 1},
    "/inference/v1/generate": {"token_ids": [1], "sampling_params": {"max_tokens": 1}},
}



async def send(client, path: str, body=None, data: bytes | None = None):
    resp = await client.post(path, json=body) if data is None else await client.post(path, data=data)
    return resp.status, await resp.json()


def chat(content) -> dict:
    return {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": content}], "max_tokens": 1}


@pytest.mark.parametrize("content, text", [
    ([{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}], "Hello\nworld"),  # vLLM's separator
    (["bare", {"type": "text", "text": "string"}], "bare\nstring"),
    ([], ""),
    (None, ""),
])
async def test_chat_content_parts_reach_the_worker_as_one_string(content, text):
    engine = FakeEngine()
    async with api_client(engine) as client:
        body = chat(content)
        body["messages"][1]["name"] = "alice"  # reaches the template, as in vLLM; other keys stay at the front
        status, _ = await send(client, "/v1/chat/completions", body)
    assert status == 200
    assert engine.requests[0][0].messages == [{"role": "system", "content": "be brief"},
                                              {"role": "user", "content": text, "name": "alice"}]


@pytest.mark.parametrize("content, param, message", [
    ([{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
     "messages[1].content[1].type",
     "messages[1].content[1].type 'image_url' is not supported: this model takes text only (content parts of type 'text')"),
    ([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}], "messages[1].content[0].type",
     "messages[1].content[0].type 'input_audio' is not supported: this model takes text only (content parts of type 'text')"),
    ([{"text": "no type"}], "messages[1].content[0]", "messages[1].content[0] must be an object with a string 'type'"),
    ([7], "messages[1].content[0]", "messages[1].content[0] must be an object with a string 'type'"),
    ([{"type": "text", "text": ["x"]}], "messages[1].content[0].text", "messages[1].content[0].text must be a string"),
    ({"type": "text"}, "messages", "messages[1].content must be a string or a list of content parts"),
])
async def test_chat_content_parts_that_are_not_text_are_400(content, param, message):
    engine = FakeEngine()
    async with api_client(engine) as client:
        assert await send(client, "/v1/chat/completions", chat(content)) == (400, bad_request(message, param))
    assert engine.requests == []


@pytest.mark.parametrize("path, field", [
    ("/generate", b"text"), ("/v1/completions", b"prompt"), ("/v1/chat/completions", b"messages"),
    ("/inference/v1/generate", b"unknown_field"), ("/abort_requests", b"unknown_field"), ("/sleep", b"unknown_field"),
])
async def test_json_nested_too_deeply_is_400(path, field):
    engine = FakeEngine()
    async with api_client(engine) as client:
        status, body = await send(client, path, data=b'{"' + field + b'": ' + DEEP + b"}")
    assert (status, body) == (400, bad_request("malformed JSON body: it is nested too deeply"))
    assert engine.requests == [] and engine.utility_calls == []


@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/completions", {"prompt": "a", "max_tokens": 2**70}, "max_tokens",
     "invalid request body: Expected `int` <= 9223372036854775807 - at `$.max_tokens`"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": -(2**64), "logprobs": True},
     "top_logprobs", "invalid request body: Expected `int` >= -9223372036854775808 - at `$.top_logprobs`"),
    ("/generate", {"text": "a", "sampling_params": {"top_k": 2**64}}, "sampling_params.top_k",
     "invalid request body: Expected `int` <= 9223372036854775807 - at `$.sampling_params.top_k`"),
    ("/generate", {"text": "a", "sampling_params": {"stop_token_ids": [1, 2**64]}}, "sampling_params.stop_token_ids",
     "invalid request body: Expected `int` <= 9223372036854775807 - at `$.sampling_params.stop_token_ids[1]`"),
    ("/inference/v1/generate", {"token_ids": [1], "priority": 2**63}, "priority",
     "invalid request body: Expected `int` <= 9223372036854775807 - at `$.priority`"),
    ("/v1/completions", {"prompt": "a", "n": 2**80}, "n",
     "invalid request body: Expected `int` <= 9223372036854775807 - at `$.n`"),
    ("/v1/completions", {"prompt": "a", "routed_dp_rank": 2**64}, "routed_dp_rank",
     "invalid request body: Expected `int` <= 9223372036854775807 - at `$.routed_dp_rank`"),
    ("/v1/completions", {"prompt": "a", "routed_dp_rank": 2**40}, "routed_dp_rank",
     "DP rank 1099511627776 is not active (dp_size=2)"),
    ("/generate", {"text": "a", "bootstrap_port": 70000}, "bootstrap_port",
     "invalid request body: Expected `int` <= 65535 - at `$.bootstrap_port`"),
    ("/generate", {"text": "a", "bootstrap_room": -1}, "bootstrap_room",
     "invalid request body: Expected `int` >= 0 - at `$.bootstrap_room`"),
    ("/v1/completions", b'{"prompt": "a", "temperature": 1e999}', "temperature",
     "invalid request body: Number out of range - at `$.temperature`"),
])
async def test_integers_past_64_bits_and_out_of_range_fields_are_400(path, body, param, message):
    engine = FakeEngine()
    async with api_client(engine) as client:
        raw = isinstance(body, bytes)
        assert await send(client, path, None if raw else body, body if raw else None) == (400, bad_request(message, param))
    assert engine.requests == []


SEED_RANGE = "an integer between -9223372036854775808 and 9223372036854775807 (64-bit signed)"


@pytest.mark.parametrize("path, body, got", [
    ("/generate", {"input_ids": [5, 6, 7], "sampling_params": {"sampling_seed": 2**70}}, 2**70),
    ("/v1/completions", {"prompt": "a", "seed": 2**63}, 2**63),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "seed": -(2**63) - 1}, -(2**63) - 1),
    ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"seed": 2**64}}, 2**64),
])
async def test_seeds_outside_64_bits_are_400_with_the_range(path, body, got):
    async with api_client(FakeEngine()) as client:
        assert await send(client, path, body) == (400, bad_request(f"seed must be {SEED_RANGE}, got {got}", "seed"))


@pytest.mark.parametrize("field, value, param", [
    ("request_id", "a\nb", "request_id"), ("request_id", "a\x7fb", "request_id"), ("request_id", "x" * 257, "request_id"),
])
async def test_request_ids_that_cannot_go_back_in_a_header_are_400(field, value, param):
    engine = FakeEngine()
    async with api_client(engine) as client:
        status, body = await send(client, "/v1/completions", {"prompt": "a", "max_tokens": 1, field: value})
        assert (status, body) == (400, bad_request(
            "request_id must have at most 256 characters and no control characters: it is sent back in the "
            "X-Request-Id header", param))
        status, body = await send(client, "/generate", {"text": "a", "rid": "é-\u2028-" + "y" * 250})
    assert (status, body["meta_info"]["id"]) == (200, "é-\u2028-" + "y" * 250)


async def test_unset_max_tokens_travel_unset_with_the_endpoints_default():
    engine = FakeEngine()
    async with api_client(engine) as client:
        for path, body in GENERATE.items():
            body = {k: v for k, v in body.items() if k != "max_tokens"}
            body.get("sampling_params", {}).pop("max_new_tokens", None)
            body.get("sampling_params", {}).pop("max_tokens", None)
            assert (await send(client, path, body))[0] == 200
    assert [(m.sampling.max_tokens, m.sampling.default_max_tokens) for m, _ in engine.requests] == [
        (None, 128), (None, 16), (None, None), (None, None)]


async def test_max_tokens_past_the_context_are_400_with_vllms_message():
    engine = FakeEngine()  # context 64
    async with api_client(engine) as client:
        status, body = await send(client, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 62})
    assert (status, body) == (400, bad_request(
        "This model's maximum context length is 64 tokens. However, you requested 65 tokens (3 in the messages, 62 in "
        "the completion). Please reduce the length of the messages or completion.", "max_tokens"))


ONE_FLOW = ("kv_transfer_params with do_remote_decode or do_remote_prefill (the pull flow) and bootstrap_room "
            "(the push flow) cannot be combined: a request takes one P/D flow (send it through one P/D router)")


@pytest.mark.parametrize("path", GENERATE)
@pytest.mark.parametrize("params", [{"do_remote_decode": True}, {"do_remote_prefill": True, "remote_port": 1}])
@pytest.mark.parametrize("room", [7, 0])
async def test_a_pull_request_with_a_bootstrap_room_is_400_at_once(path, params, room):
    engine = FakeEngine()
    async with api_client(engine) as client:
        body = dict(GENERATE[path], kv_transfer_params=params, bootstrap_host="127.0.0.1", bootstrap_port=8998,
                    bootstrap_room=room)
        assert await send(client, path, body) == (400, bad_request(ONE_FLOW, "kv_transfer_params"))
    assert engine.requests == []


@pytest.mark.parametrize("extra", [
    {"kv_transfer_params": {"do_remote_decode": True}},  # the pull flow alone
    {"bootstrap_room": 7},  # the push flow alone
    {"kv_transfer_params": {"do_remote_decode": False, "do_remote_prefill": False}, "bootstrap_room": 7},
    {"kv_transfer_params": {"do_remote_decode": "yes"}, "bootstrap_room": 7},  # not a pull request: true only
])
async def test_one_flow_or_flags_that_are_not_true_pass(extra):
    engine = FakeEngine()
    async with api_client(engine) as client:
        status, _ = await send(client, "/v1/completions", dict(GENERATE["/v1/completions"], **extra))
    assert (status, len(engine.requests)) == (200, 1)


async def test_a_batch_with_rooms_and_a_pull_request_is_400():
    engine = FakeEngine()
    async with api_client(engine) as client:
        body = {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 1}, "bootstrap_room": [1, 2],
                "kv_transfer_params": {"do_remote_decode": True}}
        assert await send(client, "/generate", body) == (400, bad_request(ONE_FLOW, "kv_transfer_params"))
    assert engine.requests == []
