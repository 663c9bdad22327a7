"""A request that has sent its client nothing can be handed back (api/generation.py: what a decode leaving its
role does): it answers the given error as its HTTP status, never a 200 stream, and is aborted on its worker;
one that already streamed goes on to its end."""

import asyncio

import pytest
from fake_engine import FakeEngine, api_client, sse_events

from disagg.api.generation import hand_back_unanswered
from disagg.api.state import STATE
from disagg.http_edge import HttpError
from disagg.types import ErrorCode

pytestmark = pytest.mark.timeout(30)
BODY = {"model": "fake-model", "prompt": "hello world", "max_tokens": 3, "stream": True}


async def test_only_what_sent_nothing_is_handed_back():
    engine = FakeEngine(token_delay_s=0.3)
    async with api_client(engine) as client:
        state = client.server.app[STATE]
        first = await client.post("/v1/completions", json={**BODY, "request_id": "streaming"})
        assert first.status == 200  # its first token came: headers and that token are out
        second = asyncio.create_task(client.post("/v1/completions", json={**BODY, "request_id": "queued"}))
        while "queued" not in state.handbacks:
            await asyncio.sleep(0.01)
        error = HttpError(503, "this server is switching its role to prefill: send the request to another server",
                          code=ErrorCode.ROLE_SWITCHING)
        assert await hand_back_unanswered(state, error) == 1
        refused = await second
        body = await refused.json()
        streamed = sse_events(await first.text())
        assert await hand_back_unanswered(state, error) == 0 and state.handbacks == {}
    assert (refused.status, body["error"]["code"], body["error"]["message"]) == (503, "role_switching", error.message)
    assert [c["choices"][0]["text"] for c in streamed[:-1] if c["choices"]] == [" w100", " w101", " w102"]
    assert engine.abort_calls[0] == ("queued", True)  # aborted on its worker, by the hand-back
