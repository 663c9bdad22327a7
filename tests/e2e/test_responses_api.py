"""The Responses API with the openai SDK's `responses.create` (tiny model, greedy): plain, streamed,
with a function tool, with `text.format`, with `previous_response_id` on a unified server and through
our router on P/D, each equal to the chat completion of the same messages; `responses.retrieve` and
`responses.delete` of stored answers; background runs polled and cancelled."""

import asyncio
import json

import openai
import pytest


pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]
GREEDY = {"temperature": 0, "max_output_tokens": 6}
WEATHER = {"type": "function", "name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                          "required": ["city"], "additionalProperties": False}}


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


async def chat_text(url: str, messages: list[dict]) -> str:
    reply = await client(url).chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=6)
    return reply.choices[0].message.content


async def streamed(url: str, **request) -> tuple[list[str], object]:
    events = [e async for e in await client(url).responses.create(model="tiny", stream=True, **request)]
    return [e.type for e in events], events


async def test_plain_and_streamed_equal_the_chat(unified_url, router_url):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    for url in (unified_url, router_url):
        want = await chat_text(unified_url, messages)
        response = await client(url).responses.create(model="tiny", instructions="Be brief.", input="Hello there",
                                                      **GREEDY)
        assert (response.object, response.status, response.output_text) == ("response", "incomplete", want)
        assert response.incomplete_details.reason == "max_output_tokens"
        assert (response.usage.output_tokens, response.output[0].type, response.output[0].role) == (6, "message", "assistant")
        kinds, events = await streamed(url, instructions="Be brief.", input="Hello there", **GREEDY)
        assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added"]
        assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                              "response.completed"]
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want
        assert events[-1].response.output_text == want
        assert [e.sequence_number for e in events] == list(range(len(events)))


async def test_a_function_tool_and_a_previous_response(unified_url):
    called = await client(unified_url).responses.create(
        model="tiny", input=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER], tool_choice="required",
        temperature=0, max_output_tokens=100)
    [call] = called.output
    assert (call.type, call.name, json.loads(call.arguments)["city"] in ("Paris", "Rome")) == (
        "function_call", "get_weather", True)
    follow = await client(unified_url).responses.create(
        model="tiny", previous_response_id=called.id, tools=[WEATHER], tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}], **GREEDY)
    want = await chat_text(unified_url, [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}])
    assert (follow.previous_response_id, follow.output_text) == (called.id, want)
    again = await client(unified_url).responses.create(model="tiny", previous_response_id=follow.id,
                                                       input="And Rome?", **GREEDY)
    assert again.output_text == await chat_text(unified_url, [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
        {"role": "assistant", "content": want}, {"role": "user", "content": "And Rome?"}])
    with pytest.raises(openai.BadRequestError, match="previous_response_id 'resp-none' is not stored"):
        await client(unified_url).responses.create(model="tiny", previous_response_id="resp-none", input="x")


async def test_text_format_and_pd_follow_ups(unified_url, router_url):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    shaped = await client(unified_url).responses.create(
        model="tiny", input="Answer in JSON", temperature=0, max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    assert set(json.loads(shaped.output_text)) == {"ok"}
    # On P/D the decode keeps the turn; our router hands it to both legs of the follow-up.
    first = await client(router_url).responses.create(model="tiny", input="Hello there", **GREEDY)
    follow = await client(router_url).responses.create(model="tiny", previous_response_id=first.id,
                                                       input="And then?", **GREEDY)
    assert follow.output_text == await chat_text(unified_url, [
        {"role": "user", "content": "Hello there"}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"}])
    with pytest.raises(openai.BadRequestError, match="'resp-gone' is not stored on any decode server"):
        await client(router_url).responses.create(model="tiny", previous_response_id="resp-gone", input="x", **GREEDY)


async def test_retrieve_and_delete_a_stored_response(unified_url, router_url):
    for url in (unified_url, router_url):  # through the router, the decode that stored it answers
        made = await client(url).responses.create(model="tiny", input="Hello there", **GREEDY)
        got = await client(url).responses.retrieve(made.id)
        assert got.model_dump() == made.model_dump()
        completed = (await streamed(url, input="Hi", **GREEDY))[1][-1].response  # response.completed's
        assert (await client(url).responses.retrieve(completed.id)).model_dump() == completed.model_dump()
        assert await client(url).responses.delete(made.id) is None
        with pytest.raises(openai.NotFoundError, match="not found"):
            await client(url).responses.retrieve(made.id)
        with pytest.raises(openai.BadRequestError, match="is not stored"):
            await client(url).responses.create(model="tiny", previous_response_id=made.id, input="x", **GREEDY)
        unkept = await client(url).responses.create(model="tiny", input="Hello", store=False, **GREEDY)
        with pytest.raises(openai.NotFoundError) as caught:
            await client(url).responses.retrieve(unkept.id)
        assert caught.value.body["code"] == "response_not_found"


async def ended(url: str, response_id: str, timeout_s: float = 30.0):
    """The Response of a background run once it ended (polled with `responses.retrieve`)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (got := await client(url).responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert asyncio.get_running_loop().time() < deadline, got.status
        await asyncio.sleep(0.05)
    return got


async def test_background_runs_poll_to_the_same_answer_and_a_cancel_frees_every_block(unified_url, router_url,
                                                                                       cluster):
    want = await chat_text(unified_url, [{"role": "user", "content": "Hello there"}])
    for url in (unified_url, router_url):  # through the router the decode runs it; the prefill leg is as usual
        queued = await client(url).responses.create(model="tiny", input="Hello there", background=True, **GREEDY)
        assert (queued.status, queued.output, queued.background) == ("queued", [], True)
        done = await ended(url, queued.id)
        assert (done.status, done.output_text, done.usage.output_tokens, done.background) == (
            "incomplete", want, 6, True)
        follow = await client(url).responses.create(model="tiny", previous_response_id=queued.id, input="And then?",
                                                    **GREEDY)
        assert follow.output_text == await chat_text(unified_url, [
            {"role": "user", "content": "Hello there"}, {"role": "assistant", "content": want},
            {"role": "user", "content": "And then?"}])
        running = await client(url).responses.create(model="tiny", input="Go on", background=True, temperature=0,
                                                     max_output_tokens=400, extra_body={"ignore_eos": True})
        cancelled = await client(url).responses.cancel(running.id)
        assert (cancelled.id, cancelled.status) == (running.id, "cancelled")
        assert (await client(url).responses.retrieve(running.id)).status == "cancelled"
        with pytest.raises(openai.BadRequestError, match=r"Cannot cancel a synchronous response\."):
            await client(url).responses.cancel(running.id)
        with pytest.raises(openai.BadRequestError, match=r"background can only be used when `store` is true"):
            await client(url).responses.create(model="tiny", input="x", background=True, store=False)
    assert await cluster.settled(([96, 96], [96, 96])) == ([96, 96], [96, 96])


async def test_a_streamed_background_run_is_followed_again_after_its_client_left(unified_url, router_url, cluster):
    want = await chat_text(unified_url, [{"role": "user", "content": "Hello there"}])
    for url in (unified_url, router_url):
        stream = await client(url).responses.create(model="tiny", input="Hello there", background=True, stream=True,
                                                    **GREEDY)
        first = []
        async for event in stream:
            first.append(event)
            if len(first) == 2:
                break
        await stream.close()  # the client leaves; the run goes on
        rest = [e async for e in await client(url).responses.retrieve(first[0].response.id, stream=True,
                                                                     starting_after=1)]
        assert [e.type for e in first] == ["response.created", "response.in_progress"]
        assert [e.sequence_number for e in first + rest] == list(range(len(first) + len(rest)))
        assert "".join(e.delta for e in rest if e.type == "response.output_text.delta") == want
        assert (rest[-1].type, rest[-1].response.output_text) == ("response.completed", want)
        stored = await client(url).responses.retrieve(first[0].response.id)
        assert (stored.status, stored.output_text, stored.background) == ("incomplete", want, True)
    assert await cluster.settled(([96, 96], [96, 96])) == ([96, 96], [96, 96])
