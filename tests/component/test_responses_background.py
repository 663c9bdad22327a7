"""Responses in the background over real HTTP against the fake engine (a token every 0.2 s): the answer
at once is `queued`, polling sees `in_progress` and the whole Response; cancel, its refusals, a failed
run, and a server that stops cancels what still runs."""

import asyncio
import json
import time

import pytest
from fake_engine import FakeEngine, api_client

from disagg.api.generation import hand_back_unanswered
from disagg.api.responses_store import STORE
from disagg.api.responses_background import BackgroundRuns
from disagg.api.state import STATE
from disagg.http_edge import HttpError
from disagg.types import ErrorCode

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


async def test_a_background_run_without_store_is_a_400():
    engine = FakeEngine()
    async with api_client(engine) as client:
        status, body = await post(client, "/v1/responses", {"input": "a", "background": True, "store": False})
    assert (status, body["error"]["param"], body["error"]["message"]) == (
        400, "background", "background can only be used when `store` is true")
    assert engine.requests == []


async def events_of(resp, count: int | None = None) -> list:
    """The `data:` payloads of an SSE answer (the first `count` of them, then it is closed)."""
    out = []
    async for line in resp.content:
        if line.startswith(b"data: "):
            out.append(line[6:].strip().decode())
            if count is not None and len(out) == count:
                resp.close()
                break
    return [e if e == "[DONE]" else json.loads(e) for e in out]


async def test_a_streamed_run_goes_on_without_its_client_and_is_followed_again():
    engine = FakeEngine(token_delay_s=0.2)
    async with api_client(engine) as client:
        resp = await client.post("/v1/responses", json={"input": "hello world", "max_output_tokens": 3,
                                                        "background": True, "stream": True, "request_id": "bg5"})
        assert (resp.status, resp.headers["Content-Type"]) == (200, "text/event-stream")
        first = await events_of(resp, 2)  # then the client leaves
        again = await client.get("/v1/responses/bg5", params={"stream": "true", "starting_after": "1"})
        rest = await events_of(again)
        whole = await (await client.get("/v1/responses/bg5")).json()
        replay = await events_of(await client.get("/v1/responses/bg5?stream=true"))
        refused = [await post_get(client, path) for path in (
            "/v1/responses/bg5?stream=true&starting_after=x", "/v1/responses/nope?stream=true")]
        await post(client, "/v1/responses", {"input": "d", "max_output_tokens": 1, "request_id": "plain"})
        refused.append(await post_get(client, "/v1/responses/plain?stream=true"))
    assert [e["type"] for e in first] == ["response.created", "response.in_progress"]
    assert [e["type"] for e in rest[:-1]] == [
        "response.output_item.added", "response.content_part.added"] + ["response.output_text.delta"] * 3 + [
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in first + rest[:-1]] == list(range(11)) and rest[-1] == "[DONE]"
    assert "".join(e["delta"] for e in rest if e != "[DONE]" and e["type"] == "response.output_text.delta") == TEXT
    assert rest[-2]["response"] == whole and whole["status"] == "incomplete" and replay[:-1] == first + rest[:-1]
    assert engine.aborted == []
    assert refused == [(400, "starting_after", "starting_after must be an integer, got 'x'"),
                       (404, None, "Response with id 'nope' not found."),
                       (400, "stream", "response 'plain' was not run in the background with stream: true (or its "
                                       "events are no longer kept: the last 64 are); retrieve it without stream")]


async def post_get(client, path: str) -> tuple[int, str | None, str]:
    resp = await client.get(path)
    body = await resp.json()
    return resp.status, body["error"]["param"], body["error"]["message"]


async def test_a_streamed_run_that_fails_ends_with_response_failed():
    engine = FakeEngine()
    engine.script.error_after = 1
    async with api_client(engine) as client:
        resp = await client.post("/v1/responses", json={"input": "a", "max_output_tokens": 4, "background": True,
                                                        "stream": True, "request_id": "bg6"})
        events = await events_of(resp)
    assert [e["type"] for e in events[:-1]][-1] == "response.failed" and events[-1] == "[DONE]"
    assert (events[-2]["response"]["status"], events[-2]["response"]["error"]) == (
        "failed", {"code": "server_error", "message": "worker failed"})


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


async def test_a_run_is_not_handed_back_by_a_role_switch_nor_forgotten_nor_left_running_once_deleted():
    """A background run already answered its client (`queued`): a role switch's hand-back leaves it to run; the
    store's bound forgets older answers first, never a run still going; DELETE cancels a run before forgetting
    it, and it does not come back when it would have ended."""
    engine = FakeEngine(token_delay_s=0.2)
    async with api_client(engine) as client:
        state, store = client.server.app[STATE], client.server.app[STORE]
        store.max_size = 2
        await post(client, "/v1/responses", {"input": "a", "max_output_tokens": 20, "background": True,
                                             "request_id": "run"})
        error = HttpError(503, "switching", code=ErrorCode.ROLE_SWITCHING)
        assert await hand_back_unanswered(state, error) == 0
        for rid in ("old1", "old2"):
            await post(client, "/v1/responses", {"input": "b", "max_output_tokens": 1, "request_id": rid})
        kept = [(await client.get(f"/v1/responses/{rid}")).status for rid in ("run", "old1", "old2")]
        streamed = await post_get(client, "/v1/responses/run?stream=true")
        await post(client, "/v1/responses", {"input": "a", "max_output_tokens": 50, "background": True,
                                             "request_id": "gone"})
        deleted = await client.delete("/v1/responses/gone")
        await asyncio.sleep(0.5)
        after = (await client.get("/v1/responses/gone")).status
    assert kept == [200, 404, 200]  # the oldest answer went, not the run
    assert streamed == (400, "stream", "response 'run' was not run in the background with stream: true (or its "
                                       "events are no longer kept: the last 64 are); retrieve it without stream")
    assert (deleted.status, after, engine.aborted) == (200, 404, ["gone", "run"])  # "run": the server stopped


async def test_a_run_cancelled_before_it_began_still_ends_its_events():
    runs, ended = BackgroundRuns(), []

    async def never() -> None:
        raise AssertionError("cancelled before its first step")

    runs.start("early", never(), lambda: ended.append("early"))
    await runs.cancel("early")
    assert ended == ["early"] and "early" not in runs


def test_the_store_keeps_the_events_of_the_last_streamed_runs_and_of_every_run_still_going(monkeypatch):
    import disagg.api.responses_store as responses
    from disagg.api.responses_background import EventLog

    monkeypatch.setattr(responses, "MAX_EVENT_LOGS", 2)
    store, logs = responses.ResponseStore(), {}
    for rid in ("a", "b", "c", "d"):
        logs[rid] = EventLog()
        if rid in ("a", "c", "d"):
            logs[rid].end()  # "b" still runs
        store.keep_events(rid, logs[rid])
    assert list(store.logs) == ["b", "d"]  # the ended "a", then "c", went past the bound; "b" runs on
