"""Behaviour every route shares, over real HTTP: DP routing, errors, API key, request ids, aborts
on disconnect, structured logs."""

import asyncio
import json

import aiohttp
import pytest
import structlog
from aiohttp import web
from fake_engine import FakeEngine, LONG_MODEL, api_client, sse_events, wait_for

from disagg.api.app import create_app, start_server
from disagg.api.logging import configure_logging
from disagg.api.state import STATE
from disagg.config import ServerConfig

pytestmark = pytest.mark.timeout(30)
ENDPOINTS = {
    "/v1/completions": {"prompt": "a", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "a"}], "max_tokens": 2},
    "/generate": {"text": "a", "sampling_params": {"max_new_tokens": 2}},
    "/inference/v1/generate": {"token_ids": [1], "sampling_params": {"max_tokens": 2}},
}


def served_rank(path: str, body: dict) -> int:
    return body["meta_info"]["dp_rank"] if path == "/generate" else body["dp_rank"]


def error(message, error_type="BadRequestError", param=None, code=None):
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


async def post(client, path, body, **kw):
    resp = await client.post(path, json=body, **kw)
    ctype = resp.headers.get("Content-Type", "")
    return resp, (await resp.json() if ctype.startswith("application/json") else await resp.text())


@pytest.mark.parametrize("path", ENDPOINTS)
async def test_dp_routing_body_alias_and_header(path):
    engine = FakeEngine(dp_size=3)
    base = ENDPOINTS[path]
    cases = [
        ({"routed_dp_rank": 2}, {}, 2),
        ({"data_parallel_rank": 1}, {}, 1),
        ({"routed_dp_rank": 2, "data_parallel_rank": 1}, {}, 2),
        ({"routed_dp_rank": 2}, {"x-DATA-parallel-RANK": "0"}, 0),
        ({}, {"X-data-parallel-rank": " 1 "}, 1),
    ]
    async with api_client(engine) as client:
        for extra, headers, rank in cases:
            resp, body = await post(client, path, {**base, **extra}, headers=headers)
            assert (resp.status, resp.headers["X-data-parallel-rank"], served_rank(path, body)) == (200, str(rank), rank)
            assert engine.requests[-1][1] == rank


@pytest.mark.parametrize("path", ENDPOINTS)
async def test_dp_routing_errors(path):
    base = ENDPOINTS[path]
    async with api_client(FakeEngine(dp_size=3)) as client:
        resp, body = await post(client, path, {**base, "routed_dp_rank": 5})
        assert (resp.status, body) == (400, error("DP rank 5 is not active (dp_size=3)", param="routed_dp_rank"))
        resp, body = await post(client, path, {**base, "data_parallel_rank": -1})
        assert (resp.status, body) == (400, error("DP rank -1 is not active (dp_size=3)", param="routed_dp_rank"))
        resp, body = await post(client, path, base, headers={"X-Data-Parallel-Rank": "one"})
        assert (resp.status, body) == (400, error("X-data-parallel-rank header must be an integer, got 'one'",
                                                  param="X-data-parallel-rank"))
        resp, body = await post(client, path, {**base, "routed_dp_rank": "1"})
        assert (resp.status, body) == (400, error(
            "invalid request body: Expected `int | null`, got `str` - at `$.routed_dp_rank`", param="routed_dp_rank"))


@pytest.mark.parametrize("path", ENDPOINTS)
async def test_bootstrap_fields_reach_the_engine_and_pick_the_rank(path):
    engine = FakeEngine(dp_size=3, load_balance_method="follow_bootstrap_room")
    pd = {"bootstrap_host": "10.1.2.3", "bootstrap_port": 8998, "bootstrap_room": 7, "disagg_prefill_dp_rank": 2}
    async with api_client(engine) as client:
        resp, body = await post(client, path, {**ENDPOINTS[path], **pd})
        assert (resp.status, served_rank(path, body)) == (200, 1)  # 7 % 3
        msg = engine.requests[-1][0]
        assert (msg.bootstrap_host, msg.bootstrap_port, msg.bootstrap_room, msg.disagg_prefill_dp_rank) == (
            "10.1.2.3", 8998, 7, 2)
        resp, body = await post(client, path, ENDPOINTS[path])
        assert (resp.status, body["error"]["param"]) == (400, "bootstrap_room")


@pytest.mark.parametrize("path", ENDPOINTS)
async def test_every_stream_chunk_names_the_rank(path):
    async with api_client(FakeEngine(dp_size=2)) as client:
        resp, raw = await post(client, path, {**ENDPOINTS[path], "stream": True}, headers={"X-data-parallel-rank": "1"})
    assert resp.headers["X-data-parallel-rank"] == "1"
    events = sse_events(raw)
    assert events[-1] == "[DONE]" and len(events) >= 3
    assert {served_rank(path, e) for e in events[:-1]} == {1}


async def test_malformed_bodies_are_4xx_and_the_server_lives_on():
    async with api_client(FakeEngine(), max_body_bytes=1024) as client:
        cases = [
            (b'{"prompt": ', 400, "malformed JSON body: Input data was truncated"),
            (b'[1, 2]', 400, "invalid request body: Expected `object`, got `array`"),
            (b'', 400, "the request body is empty: send a JSON object"),
            (b'{"prompt": "\xff"}', 400, "malformed JSON body: it is not valid UTF-8"),
        ]
        for data, status, message in cases:
            resp = await client.post("/v1/completions", data=data, headers={"Content-Type": "application/json"})
            assert (resp.status, (await resp.json())["error"]["message"]) == (status, message)
        resp = await client.post("/generate", data=b'{"text": "' + b"a" * 5000 + b'"}')
        body = await resp.json()
        assert (resp.status, body["error"]["type"]) == (413, "RequestTooLargeError")
        assert body["error"]["message"] == "request body too large: Maximum request body size 1024 exceeded."
        resp, body = await post(client, "/v2/nothing", {})
        assert (resp.status, body) == (404, error("Not Found: POST /v2/nothing", "NotFoundError", code="route_not_found"))
        resp = await client.get("/v1/completions")
        assert (resp.status, (await resp.json())["error"]["type"]) == (405, "MethodNotAllowedError")
        assert (await client.get("/health")).status == 200


async def test_internal_errors_are_500_json():
    engine = FakeEngine()

    def broken(routed_dp_rank, bootstrap_room, msg=None):
        raise RuntimeError("boom")

    engine.pick_rank = broken
    async with api_client(engine) as client:
        resp, body = await post(client, "/generate", ENDPOINTS["/generate"])
        assert (resp.status, body) == (500, error("internal error: RuntimeError: boom", "InternalServerError"))
        assert (await client.get("/health")).status == 200


async def test_api_key_guards_everything_but_the_probes():
    async with api_client(FakeEngine(), api_key="k1") as client:
        unauthorized = error("Invalid or missing API key: send 'Authorization: Bearer <key>'", "AuthenticationError",
                             code="invalid_api_key")
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "k1"}):
            resp, body = await post(client, "/generate", ENDPOINTS["/generate"], headers=headers)
            assert (resp.status, body) == (401, unauthorized)
        assert (await client.get("/server_info")).status == 401
        resp, _ = await post(client, "/generate", ENDPOINTS["/generate"], headers={"Authorization": "Bearer k1"})
        assert resp.status == 200
        assert (await client.get("/health")).status == 200 and (await client.get("/metrics")).status == 200


async def test_request_ids():
    engine = FakeEngine(model=LONG_MODEL, token_delay_s=0.02)
    async with api_client(engine) as client:
        resp, body = await post(client, "/v1/completions", ENDPOINTS["/v1/completions"], headers={"X-Request-Id": "hdr-1"})
        assert (body["id"], resp.headers["X-Request-Id"]) == ("hdr-1", "hdr-1")
        _, body = await post(client, "/inference/v1/generate", {**ENDPOINTS["/inference/v1/generate"], "request_id": "b-1"},
                             headers={"X-Request-Id": "hdr-2"})
        assert body["request_id"] == "b-1"
        _, body = await post(client, "/generate", {**ENDPOINTS["/generate"], "rid": "r-1"})
        assert body["meta_info"]["id"] == "r-1"
        running = await client.post("/generate", json={"text": "a", "rid": "dup", "stream": True,
                                                       "sampling_params": {"max_new_tokens": 500}})
        await running.content.readuntil(b"\n\n")
        resp, body = await post(client, "/generate", {**ENDPOINTS["/generate"], "rid": "dup"})
        assert (resp.status, body) == (400, error("request id 'dup' is already in use", param="request_id"))
        running.close()


@pytest.mark.parametrize("handler_cancellation", [True, False])
async def test_disconnect_mid_stream_aborts_the_request(handler_cancellation):
    """With handler cancellation the handler is cancelled; without it, the next write fails. Both abort."""
    engine = FakeEngine(model=LONG_MODEL, token_delay_s=0.01)
    runner = web.AppRunner(create_app(ServerConfig(port=0), engine, configure_logs=False),
                           handler_cancellation=handler_cancellation)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession() as session:
            resp = await session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "a"}], "max_tokens": 1000, "stream": True, "request_id": "gone"})
            assert json.loads((await resp.content.readuntil(b"\n\n"))[6:])["id"] == "gone"
            resp.close()
        await wait_for(lambda: engine.aborted == ["gone"])
        await wait_for(lambda: engine.abort_calls == [("gone", False)])  # the close already aborted it
        assert runner.app[STATE].inflight == {}
    finally:
        await runner.cleanup()


async def test_disconnect_while_waiting_for_a_non_stream_answer_aborts():
    engine = FakeEngine(model=LONG_MODEL, token_delay_s=0.01)
    runner, port = await start_server(create_app(ServerConfig(port=0), engine, configure_logs=False), "127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as session:
            task = asyncio.create_task(session.post(f"http://127.0.0.1:{port}/generate", json={
                "text": "a", "rid": "left", "sampling_params": {"max_new_tokens": 1000}}))
            await wait_for(lambda: engine.requests)
            task.cancel()
        await wait_for(lambda: engine.aborted == ["left"])
        await wait_for(lambda: engine.abort_calls == [("left", False)])
    finally:
        await runner.cleanup()


@pytest.fixture
def json_logs(capsys):  # capsys first: the logger binds the captured stderr
    configure_logging("json")
    yield
    structlog.reset_defaults()


async def test_json_logs_bind_request_id_and_room_and_warn_once(json_logs, capsys):
    async with api_client(FakeEngine(dp_size=2)) as client:
        for rid in ("log-1", "log-2"):
            await post(client, "/generate", {**ENDPOINTS["/generate"], "rid": rid, "bootstrap_room": 42,
                                             "data_parallel_rank": 1})
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    finished = [line for line in lines if line["event"] == "request finished"]
    assert [(x["request_id"], x["bootstrap_room"], x["dp_rank"], x["path"], x["level"]) for x in finished] == [
        ("log-1", 42, 1, "/generate", "info"), ("log-2", 42, 1, "/generate", "info")]
    warnings = [x for x in lines if "deprecated" in x["event"]]
    assert [(x["event"], x["level"], x["request_id"]) for x in warnings] == [
        ("request field data_parallel_rank is deprecated; use routed_dp_rank", "warning", "log-1")]
