"""The router's API key over real HTTP, in front of the recording fake servers of test_router."""

import msgspec
import pytest
from test_router import FakeServer, cluster, get, post

pytestmark = pytest.mark.timeout(30)
UNAUTHORIZED = {"error": {"message": "Invalid or missing API key: send 'Authorization: Bearer <key>'",
                          "type": "AuthenticationError", "param": None, "code": "invalid_api_key"}}
BODY = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}


async def test_clients_need_the_api_key_and_it_goes_on_to_both_servers():
    prefill, decode = FakeServer(), FakeServer()
    async with cluster([prefill], [decode], api_key="rk") as router:
        for headers in (None, {"Authorization": "Bearer nope"}, {"Authorization": "rk"}):
            status, _, raw = await post(router, "/generate", BODY, headers)
            assert (status, msgspec.json.decode(raw)) == (401, UNAUTHORIZED)
        assert prefill.bodies == decode.bodies == []  # refused before any leg
        for path in ("/server_info", "/v1/models", "/health_generate"):
            status, _, raw = await get(router, path)
            assert (status, msgspec.json.decode(raw)) == (401, UNAUTHORIZED)
        status, _, _ = await post(router, "/generate", BODY, {"Authorization": "Bearer rk"})
        assert status == 200
        assert prefill.headers[0]["Authorization"] == decode.headers[0]["Authorization"] == "Bearer rk"
        status, _, raw = await get(router, "/v1/models", {"Authorization": "Bearer rk"})
        assert (status, msgspec.json.decode(raw)["seen_auth"]) == (200, "Bearer rk")


async def test_the_probes_stay_open():
    async with cluster([FakeServer()], [FakeServer()], api_key="rk") as router:
        status, _, raw = await get(router, "/health")
        assert (status, msgspec.json.decode(raw)) == (200, {"status": "ok", "healthy_prefill": 1, "healthy_decode": 1})
        status, _, raw = await get(router, "/metrics")  # Prometheus scrapes without the key
        assert status == 200 and b"# TYPE sgl_router_retries_total counter" in raw


async def test_without_an_api_key_everything_is_open():
    async with cluster([FakeServer()], [FakeServer()]) as router:
        assert (await post(router, "/generate", BODY))[0] == 200
        assert (await get(router, "/server_info"))[0] == 200
