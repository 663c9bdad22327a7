"""The front door's drain over real HTTP, with the in-process engine twin: health red, new requests
refused on every generate route, in-flight requests finish, and what the timeout aborts is told so."""

import asyncio
import contextlib

import aiohttp
import pytest
from fake_engine import FIRST_OUTPUT_ID, FakeEngine, sse_events, wait_for

from disagg.api.app import create_app, start_server
from disagg.api.state import STATE
from disagg.config import ServerConfig

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]
REFUSED = {"error": {"message": "server is draining: it accepts no new requests", "type": "ServiceUnavailableError",
                     "param": None, "code": "draining"}}
NEW_REQUESTS = {
    "/v1/completions": {"prompt": "a", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "a"}], "max_tokens": 2},
    "/generate": {"text": "a", "sampling_params": {"max_new_tokens": 2}},
    "/inference/v1/generate": {"token_ids": [1], "sampling_params": {"max_tokens": 2}},
}


def shut_down(timeout: str) -> dict:
    return {"error": {"message": f"server shut down before the request finished (shutdown timeout {timeout} s)",
                      "type": "ServiceUnavailableError", "param": None, "code": "shutdown"}}


@contextlib.asynccontextmanager
async def serving(engine: FakeEngine):
    """(base URL, drain, session) of a front door serving `engine` on 127.0.0.1:0."""
    app = create_app(ServerConfig(port=0), engine, configure_logs=False)
    runner, port = await start_server(app, "127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as session:
            yield f"http://127.0.0.1:{port}", app[STATE].drain, session
    finally:
        await runner.cleanup()


async def get_json(session, url: str) -> tuple[int, object]:
    async with session.get(url) as resp:
        return resp.status, await resp.json()


async def post_json(session, url: str, body: dict) -> tuple[int, object]:
    async with session.post(url, json=body) as resp:
        return resp.status, await resp.json()


async def test_a_draining_server_is_red_refuses_new_requests_and_finishes_its_streams():
    engine = FakeEngine(dp_size=1, token_delay_s=0.02)
    async with serving(engine) as (base, drain, session):
        body = {"prompt": "a", "max_tokens": 20, "stream": True, "request_id": "long"}
        async with session.post(base + "/v1/completions", json=body) as resp:
            first = await resp.content.readuntil(b"\n\n")
            draining = asyncio.create_task(drain.run(10.0))
            await asyncio.sleep(0)
            assert await get_json(session, base + "/health") == (503, REFUSED)
            assert await get_json(session, base + "/health_generate") == (503, REFUSED)
            for path, new in NEW_REQUESTS.items():
                assert await post_json(session, base + path, new) == (503, REFUSED), path
            rest = await resp.read()
        assert await draining == 0
    events = sse_events((first + rest).decode())
    chunks = [e for e in events if e != "[DONE]"]
    assert [c["choices"][0]["text"] for c in chunks] == [f" w{FIRST_OUTPUT_ID + i}" for i in range(20)]
    assert (chunks[-1]["choices"][0]["finish_reason"], events[-1]) == ("length", "[DONE]")
    assert [msg.request_id for msg, _ in engine.requests] == ["long"]  # nothing refused reached the engine
    assert engine.aborted == []


async def test_the_timeout_aborts_what_is_left_with_the_reason():
    engine = FakeEngine(dp_size=1, token_delay_s=0.05)
    async with serving(engine) as (base, drain, session):
        stream_body = {"prompt": "a", "max_tokens": 60, "stream": True, "request_id": "streamed"}
        unary = asyncio.create_task(post_json(session, base + "/generate", {
            "text": "a", "rid": "unary", "sampling_params": {"max_new_tokens": 60}}))
        async with session.post(base + "/v1/completions", json=stream_body) as resp:
            first = await resp.content.readuntil(b"\n\n")
            assert await drain.run(0.2) == 2
            rest = await resp.read()
        assert await unary == (503, shut_down("0.2"))
    *tokens, error, done = sse_events((first + rest).decode())
    assert (error, done) == (shut_down("0.2"), "[DONE]")
    assert 1 <= len(tokens) < 60  # the tokens sent before the abort, in order, none finished
    assert [t["choices"][0]["text"] for t in tokens] == [f" w{FIRST_OUTPUT_ID + i}" for i in range(len(tokens))]
    assert {t["choices"][0]["finish_reason"] for t in tokens} == {None}
    assert sorted(engine.aborted) == ["streamed", "unary"]


async def test_a_stream_aborted_before_its_first_token_gets_a_503_answer():
    engine = FakeEngine(dp_size=1, token_delay_s=5.0)
    async with serving(engine) as (base, drain, session):
        stream = asyncio.create_task(post_json(session, base + "/generate", {
            "text": "a", "rid": "slow", "stream": True, "sampling_params": {"max_new_tokens": 4}}))
        await wait_for(lambda: drain.num_in_flight == 1)
        assert await drain.run(0.1) == 1
        assert await stream == (503, shut_down("0.1"))  # a JSON answer (resp.json() checks), not a stream
    assert engine.aborted == ["slow"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_n_choices_aborted_by_the_drain_get_the_shutdown_error(stream):
    engine = FakeEngine(dp_size=1, token_delay_s=0.05)
    async with serving(engine) as (base, drain, session):
        body = {"prompt": "a", "max_tokens": 60, "n": 2, "stream": stream, "request_id": "two"}
        if stream:
            async with session.post(base + "/v1/completions", json=body) as resp:
                first = await resp.content.readuntil(b"\n\n")
                assert await drain.run(0.2) == 1
                *_, error, done = sse_events((first + await resp.read()).decode())
            assert (resp.status, error, done) == (200, shut_down("0.2"), "[DONE]")
        else:
            answer = asyncio.create_task(post_json(session, base + "/v1/completions", body))
            await wait_for(lambda: len(engine.requests) == 2)
            assert await drain.run(0.2) == 1
            assert await answer == (503, shut_down("0.2"))
    assert sorted(engine.aborted) == ["0_two", "1_two"]
