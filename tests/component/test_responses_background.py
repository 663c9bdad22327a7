"""Responses in the background over real HTTP against the fake engine (a token every 0.2 s): the answer
at once is `queued`, polling sees `in_progress` and the whole Response; cancel, its refusals, a failed
run, and a server that stops cancels what still runs."""

import asyncio
import time

import pytest
from fake_engine import FakeEngine, api_client

pytestmark = pytest.mark.timeout(30)
TEXT = " w100 w101 w102"


async def post(client, path: str, body: dict | None = None) -> tuple[int, dict]:
    resp = await client.post(path, json=body)
    return resp.status, await resp.json()


async def statuses_until_ended(client, response_id: str, timeout_s: float = 10.0) -> tuple[list[str], dict]:
    """Each status polled (every 20 ms) once, in order, and the Response that ended."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        resp = await client.get(f"/v1/responses/{response_id}")
        assert resp.status == 200
        body = await resp.json()
        if not seen or seen[-1] != body["status"]:
            seen.append(body["status"])
        if body["status"] in ("completed", "incomplete", "failed", "cancelled"):
            return seen, body
        await asyncio.sleep(0.02)
    raise AssertionError(f"still {seen[-1]} after {timeout_s} s")


async def test_a_background_run_answers_queued_then_polls_to_the_whole_response():
    engine = FakeEngine(token_delay_s=0.2)
    async with api_client(engine) as client:
        status, queued = await post(client, "/v1/responses", {"input": "hello world", "max_output_tokens": 3,
                                                              "background": True, "request_id": "bg1"})
        assert status == 200
        assert (queued["id"], queued["status"], queued["output"], queued["background"], queued["error"]) == (
            "bg1", "queued", [], True, None)
        seen, done = await statuses_until_ended(client, "bg1")
        status, plain = await post(client, "/v1/responses", {"input": "hello world", "max_output_tokens": 3})
    assert seen == ["queued", "in_progress", "incomplete"]
    assert [part["text"] for part in done["output"][0]["content"]] == [TEXT]
    assert done["usage"]["output_tokens"] == 3 and done["incomplete_details"] == {"reason": "max_output_tokens"}
    assert (status, plain["background"]) == (200, False)
    same = ("status", "output", "usage", "error", "incomplete_details")
    assert {k: done[k] for k in same if k != "output"} == {k: plain[k] for k in same if k != "output"}
    assert [o["content"] for o in done["output"]] == [o["content"] for o in plain["output"]]
    assert [m.prompt for m, _ in engine.requests] == [None, None] and engine.aborted == []


async def test_cancel_stops_a_run_and_its_refusals():
    engine = FakeEngine(token_delay_s=0.2)
    async with api_client(engine) as client:
        await post(client, "/v1/responses", {"input": "a b", "max_output_tokens": 50, "background": True,
                                             "request_id": "bg2"})
        follow = await post(client, "/v1/responses", {"input": "c", "previous_response_id": "bg2"})
        twice = await post(client, "/v1/responses", {"input": "c", "background": True, "request_id": "bg2"})
        while (await (await client.get("/v1/responses/bg2")).json())["status"] != "in_progress":
            await asyncio.sleep(0.02)
        status, cancelled = await post(client, "/v1/responses/bg2/cancel")
        assert (status, cancelled["id"], cancelled["status"]) == (200, "bg2", "cancelled")
        assert engine.aborted == ["bg2"]
        again = await post(client, "/v1/responses/bg2/cancel")
        unknown = await post(client, "/v1/responses/nope/cancel")
        await post(client, "/v1/responses", {"input": "d", "max_output_tokens": 1, "request_id": "plain"})
        whole = await post(client, "/v1/responses/plain/cancel")
        await asyncio.sleep(0.3)  # a token would have come: the run stays cancelled
        polled = await (await client.get("/v1/responses/bg2")).json()
    assert (follow[0], follow[1]["error"]["message"]) == (
        400, "previous_response_id 'bg2' has no answer to follow: its background run is queued")
    assert (polled["status"], polled["output"]) == ("cancelled", [])
    assert (twice[0], twice[1]["error"]["message"]) == (400, "request id 'bg2' is already in use")
    for (status, body), want in ((again, (400, "response_id", "Cannot cancel a synchronous response.")),
                                 (whole, (400, "response_id", "Cannot cancel a synchronous response.")),
                                 (unknown, (404, None, "Response with id 'nope' not found."))):
        assert (status, body["error"]["param"], body["error"]["message"]) == want


@pytest.mark.parametrize("extra, param, message", [
    ({"store": False}, "background", "background can only be used when `store` is true"),
    ({"stream": True}, "stream", "background responses are not streamed by this server: send stream false and "
                                 "poll GET /v1/responses/{id}"),
])
async def test_what_cannot_run_in_the_background_is_a_400(extra, param, message):
    engine = FakeEngine()
    async with api_client(engine) as client:
        status, body = await post(client, "/v1/responses", {"input": "a", "background": True, **extra})
    assert (status, body["error"]["param"], body["error"]["message"]) == (400, param, message)
    assert engine.requests == []


async def test_a_failed_run_says_why_and_the_server_goes_on():
    engine = FakeEngine()
    engine.script.error_after = 1
    async with api_client(engine) as client:
        await post(client, "/v1/responses", {"input": "a", "max_output_tokens": 4, "background": True,
                                             "request_id": "bg3"})
        seen, failed = await statuses_until_ended(client, "bg3")
        engine.script.error_after = None
        status, ok = await post(client, "/v1/responses", {"input": "a", "max_output_tokens": 1})
    assert seen[-1] == "failed" and failed["error"] == {"code": "server_error", "message": "worker failed"}
    assert (status, ok["status"]) == (200, "incomplete")


async def test_a_server_that_stops_cancels_its_runs():
    engine = FakeEngine(token_delay_s=0.2)
    async with api_client(engine) as client:
        status, _ = await post(client, "/v1/responses", {"input": "a", "max_output_tokens": 50, "background": True,
                                                         "request_id": "bg4"})
        assert status == 200
        await asyncio.sleep(0.3)
    assert engine.aborted == ["bg4"]
