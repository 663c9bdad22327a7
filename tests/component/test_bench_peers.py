"""`disagg bench engine --peers`: the streaming client against a scripted OpenAI-style server on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
from aiohttp import web

from disagg.bench.peers import format_table, measure, text_prompt

pytestmark = pytest.mark.timeout(60)


@contextlib.asynccontextmanager
async def serving(app: web.Application):
    """`app` on a loopback port; yields its base URL, always cleaned up."""
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


FIRST_TOKEN_S, NEXT_TOKEN_S = 0.04, 0.01  # the scripted server's delays: lower bounds on what is measured


def scripted_server(fail_every: int = 0) -> tuple[web.Application, list[dict]]:
    bodies: list[dict] = []

    async def models(_):
        return web.json_response({"object": "list", "data": [{"id": "peer-model", "object": "model"}]})

    async def completions(request):
        body = await request.json()
        bodies.append(body)
        if fail_every and len(bodies) % fail_every == 0:
            return web.json_response({"error": {"message": "overloaded"}}, status=503)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(body["max_tokens"]):
            await asyncio.sleep(FIRST_TOKEN_S if i == 0 else NEXT_TOKEN_S)
            await resp.write(f"data: {json.dumps({'choices': [{'index': 0, 'text': f't{i}'}]})}\n\n".encode())
        usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": body["max_tokens"]}}
        await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    return app, bodies


async def test_a_peer_gets_one_stream_then_many_and_every_request_is_counted():
    app, bodies = scripted_server()
    async with serving(app) as url:
        result = await measure("peer", url, input_len=40, output_len=6, num_sequential=3, streams=4)
    # A warm-up, 3 sequential, then 2 x 4 concurrent: all the same greedy streaming body shape.
    assert len(bodies) == 1 + 3 + 8
    assert {b["model"] for b in bodies} == {"peer-model"}
    assert all(b["stream"] and b["max_tokens"] == 6 and b["temperature"] == 0 and b["ignore_eos"] for b in bodies)
    assert len({b["prompt"] for b in bodies}) == 12  # no two prompts alike: no prefix-cache hits between them
    assert (result.num_requests, result.num_failed) == (11, 0)
    # Timings are bounded by the script's sleeps: TTFT >= 40 ms, TPOT >= 10 ms, and 4 streams of 6
    # tokens that take >= 90 ms each give at most 24 / 0.09 s = 266.7 tok/s.
    assert result.ttft_p50_ms >= FIRST_TOKEN_S * 1e3 and result.tpot_p50_ms >= NEXT_TOKEN_S * 1e3
    assert 0 < result.output_tok_s <= 4 * 6 / (FIRST_TOKEN_S + 5 * NEXT_TOKEN_S)
    assert "| peer |" in format_table([result], 4) and "| 0 of 11 |" in format_table([result], 4)


async def test_failed_requests_are_counted_not_hidden():
    app, bodies = scripted_server(fail_every=2)
    async with serving(app) as url:
        result = await measure("flaky", url, input_len=40, output_len=3, num_sequential=4, streams=2)
    assert len(bodies) == 1 + 4 + 4
    # Requests 2, 4, 6 and 8 of the server failed; the warm-up was request 1.
    assert (result.num_requests, result.num_failed) == (8, 4)


def test_a_malformed_peer_is_a_usage_error_naming_it(capsys):
    from disagg.cli import build_parser

    assert build_parser().parse_args(["bench", "engine", "--peers", "a=http://h:1", "b=https://h:2"]).peers == [
        ("a", "http://h:1"), ("b", "https://h:2")]
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["bench", "engine", "--peers", "localhost:8000"])
    assert exit_info.value.code == 2
    assert "--peers takes NAME=http(s)://HOST:PORT, got 'localhost:8000'" in capsys.readouterr().err


def test_text_prompts_are_deterministic_and_about_the_asked_length():
    assert text_prompt(3, 250) == text_prompt(3, 250) != text_prompt(4, 250)
    assert text_prompt(3, 250).startswith("Story 3: ")
    assert len(text_prompt(3, 250).split()) == 2 + int(250 / 1.3)
