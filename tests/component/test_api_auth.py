"""API key and admin key on the front door, over real HTTP against the fake engine (docs/security.md)."""

import pytest
from fake_engine import FakeEngine, api_client

pytestmark = pytest.mark.timeout(30)

ADMIN_ROUTES = [
    ("/abort_requests", {"json": {"abort_all": True}}, {"aborted": []}),
    ("/abort_request", {"json": {"rid": "r-1"}}, {"aborted": []}),
    ("/reset_prefix_cache", {}, {"success": True}),
    ("/flush_cache", {}, {"success": True}),
    ("/sleep", {}, {"success": True, "level": 1}),
    ("/wake_up", {}, {"success": True}),
]
GENERATE = {"text": "a", "sampling_params": {"max_new_tokens": 2}}
NO_KEY, API_KEY, ADMIN_KEY = {}, {"Authorization": "Bearer api-1"}, {"Authorization": "Bearer admin-1"}


def error(status_type: str, message: str, code: str) -> dict:
    return {"error": {"message": message, "type": status_type, "param": None, "code": code}}


BAD_API_KEY = error("AuthenticationError", "Invalid or missing API key: send 'Authorization: Bearer <key>'",
                    "invalid_api_key")
BAD_ADMIN_KEY = error("AuthenticationError", "Invalid or missing admin key: send 'Authorization: Bearer <admin key>'",
                      "invalid_admin_key")


def admin_disabled(path: str) -> dict:
    return error("PermissionDeniedError", f"{path} is an admin route and this server has an API key but no admin "
                 "key: start it with --admin-key (or DISAGG_ADMIN_KEY) to use it", "admin_disabled")


async def call(client, method, path, headers, **kw):
    resp = await client.request(method, path, headers=headers, **kw)
    return resp.status, await resp.json() if resp.content_type == "application/json" else await resp.text()


@pytest.mark.parametrize("path, kw, ok", ADMIN_ROUTES, ids=[r[0] for r in ADMIN_ROUTES])
async def test_admin_routes_take_the_admin_key_only(path, kw, ok):
    engine = FakeEngine(dp_size=2)
    async with api_client(engine, api_key="api-1", admin_key="admin-1") as client:
        assert await call(client, "POST", path, NO_KEY, **kw) == (401, BAD_ADMIN_KEY)
        assert await call(client, "POST", path, API_KEY, **kw) == (401, BAD_ADMIN_KEY)
        calls_before = len(engine.utility_calls)
        assert await call(client, "POST", path, ADMIN_KEY, **kw) == (200, ok)
    assert len(engine.utility_calls) - calls_before == (0 if "abort" in path else 1)


@pytest.mark.parametrize("path, kw, ok", ADMIN_ROUTES, ids=[r[0] for r in ADMIN_ROUTES])
async def test_with_an_api_key_and_no_admin_key_admin_routes_are_403(path, kw, ok):
    engine = FakeEngine(dp_size=2)
    async with api_client(engine, api_key="api-1", admin_key=None) as client:
        for headers in (NO_KEY, API_KEY, ADMIN_KEY):
            assert await call(client, "POST", path, headers, **kw) == (403, admin_disabled(path))
    assert engine.utility_calls == []


@pytest.mark.parametrize("path, kw, ok", ADMIN_ROUTES, ids=[r[0] for r in ADMIN_ROUTES])
async def test_with_neither_key_admin_routes_stay_open(path, kw, ok):
    async with api_client(FakeEngine(dp_size=2), admin_key=None) as client:
        assert await call(client, "POST", path, NO_KEY, **kw) == (200, ok)


async def test_inference_routes_take_the_api_key_only():
    async with api_client(FakeEngine(), api_key="api-1", admin_key="admin-1") as client:
        assert (await call(client, "POST", "/generate", API_KEY, json=GENERATE))[0] == 200
        assert await call(client, "POST", "/generate", ADMIN_KEY, json=GENERATE) == (401, BAD_API_KEY)
        assert await call(client, "POST", "/generate", NO_KEY, json=GENERATE) == (401, BAD_API_KEY)
        assert await call(client, "GET", "/is_sleeping", ADMIN_KEY) == (401, BAD_API_KEY)
        assert await call(client, "GET", "/is_sleeping", API_KEY) == (200, {"is_sleeping": False})
        assert (await call(client, "GET", "/health", NO_KEY))[0] == 200
        assert (await call(client, "GET", "/metrics", NO_KEY))[0] == 200


async def test_an_admin_key_alone_leaves_inference_open():
    async with api_client(FakeEngine(), admin_key="admin-1") as client:
        assert (await call(client, "POST", "/generate", NO_KEY, json=GENERATE))[0] == 200
        assert await call(client, "POST", "/flush_cache", NO_KEY) == (401, BAD_ADMIN_KEY)
        assert await call(client, "POST", "/flush_cache", ADMIN_KEY) == (200, {"success": True})
