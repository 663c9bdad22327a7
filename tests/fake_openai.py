"""Pieces of fake OpenAI servers for the bench tests: an aiohttp app on 127.0.0.1, port 0, in its own
thread and event loop (the bench commands run their own `asyncio.run`), an SSE stream of given events,
and a `/v1/models` naming `fake-model`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Iterator

from aiohttp import web


@contextlib.contextmanager
def app_in_thread(app: web.Application) -> Iterator[str]:
    """Serves `app` until the block ends; yields its base URL."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


async def stream_events(request: web.Request, events: list[dict]) -> web.StreamResponse:
    """A 200 text/event-stream of `data: EVENT` lines, then `data: [DONE]`."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for event in events:
        await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def models(_: web.Request) -> web.Response:
    """GET /v1/models with one model, `fake-model`."""
    return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})
