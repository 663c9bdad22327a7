"""Routes real routers and tools call: SGLang's /get_load, vLLM's /version and its abort body."""

import pytest

from fake_engine import LONG_MODEL, FakeEngine, api_client, open_generate_streams

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]


async def call(client, method, path, **kw):
    resp = await client.request(method, path, **kw)
    return resp.status, await resp.json()


async def test_get_load_has_one_entry_per_dp_worker_in_sglangs_shape():
    engine = FakeEngine(dp_size=2)  # worker r: r waiting, 100 - r of 128 blocks of 16 tokens free
    async with api_client(engine) as client:
        status, body = await call(client, "GET", "/get_load")
    assert (status, body) == (200, [
        {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 28 * 16},
        {"dp_rank": 1, "num_reqs": 1, "num_waiting_reqs": 1, "num_tokens": 29 * 16},
    ])
    assert sum(entry["num_tokens"] for entry in body) == 912  # what sgl-model-gateway's load policies read


async def test_get_load_counts_running_requests():
    engine = FakeEngine(dp_size=1, model=LONG_MODEL, token_delay_s=0.02)
    async with api_client(engine) as client:
        [resp] = await open_generate_streams(client, ("busy",))
        status, body = await call(client, "GET", "/get_load")
        await call(client, "POST", "/abort_requests", json={"rid": "busy"})
        await resp.text()
    assert (status, body) == (200, [{"dp_rank": 0, "num_reqs": 1, "num_waiting_reqs": 0, "num_tokens": 448}])


async def test_version_is_the_package_version():
    async with api_client(FakeEngine()) as client:
        assert await call(client, "GET", "/version") == (200, {"version": "0.1.0"})


async def test_abort_requests_takes_vllms_request_ids():
    engine = FakeEngine(dp_size=2, model=LONG_MODEL, token_delay_s=0.02)
    async with api_client(engine) as client:
        streams = await open_generate_streams(client, ("v1", "v2", "v3"))
        first = await call(client, "POST", "/abort_requests", json={"request_ids": ["v1", "v3", "gone"]})
        both = await call(client, "POST", "/abort_requests", json={"rid": "v2", "request_ids": ["nope"]})
        bodies = [await resp.text() for resp in streams]
    assert first == (200, {"aborted": ["v1", "v3"]})
    assert both == (200, {"aborted": ["v2"]})  # SGLang's and vLLM's fields together
    assert all('"finish_reason":{"type":"abort"' in b for b in bodies)


async def test_abort_with_request_ids_keeps_the_admin_key():
    async with api_client(FakeEngine(), admin_key="admin-secret") as client:
        denied = await call(client, "POST", "/abort_requests", json={"request_ids": ["x"]})
        allowed = await call(client, "POST", "/abort_requests", json={"request_ids": ["x"]},
                             headers={"Authorization": "Bearer admin-secret"})
    assert denied[0] == 401 and denied[1]["error"]["code"] == "invalid_admin_key"
    assert allowed == (200, {"aborted": []})


async def test_sglang_max_new_tokens_null_is_the_rest_of_the_context_and_absent_is_128():
    engine = FakeEngine(dp_size=1)  # a 64-token context
    async with api_client(engine) as client:
        _, null = await call(client, "POST", "/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": None}})
        _, absent = await call(client, "POST", "/generate", json={"input_ids": [1, 2], "sampling_params": {}})
        _, no_params = await call(client, "POST", "/generate", json={"input_ids": [1, 2]})
    assert [(m.sampling.max_tokens, m.sampling.default_max_tokens) for m, _ in engine.requests] == [
        (None, None), (None, 128), (None, 128)]
    assert [b["meta_info"]["completion_tokens"] for b in (null, absent, no_params)] == [62, 62, 62]
    assert null["meta_info"]["finish_reason"] == {"type": "length", "length": 62}


async def test_sglang_absent_max_new_tokens_stays_128_on_a_long_context():
    engine = FakeEngine(dp_size=1, model=LONG_MODEL)
    async with api_client(engine) as client:
        _, absent = await call(client, "POST", "/generate", json={"input_ids": [1], "sampling_params": {}})
        _, null = await call(client, "POST", "/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": None}})
    assert (absent["meta_info"]["completion_tokens"], null["meta_info"]["completion_tokens"]) == (128, 4095)


async def test_tokens_endpoint_max_tokens_unset_is_the_rest_of_the_context():
    engine = FakeEngine(dp_size=1)
    async with api_client(engine) as client:
        _, unset = await call(client, "POST", "/inference/v1/generate", json={"token_ids": [1, 2, 3]})
        _, null = await call(client, "POST", "/inference/v1/generate",
                             json={"token_ids": [1], "sampling_params": {"max_tokens": None}})
    assert [(m.sampling.max_tokens, m.sampling.default_max_tokens) for m, _ in engine.requests] == [
        (None, None), (None, None)]
    assert (len(unset["choices"][0]["token_ids"]), unset["choices"][0]["finish_reason"]) == (61, "length")
    assert len(null["choices"][0]["token_ids"]) == 63
