"""`previous_response_id` through our router on P/D: the conversation an earlier answer stored lives on
the decode that answered it (the prefill only computed its prompt), so before dispatching a
Responses request that names one, the router asks the decodes for it (`GET
/v1/responses/{id}/conversation`, our servers' route) and puts it in the body
(`disagg_conversation`), so that both legs build the same prompt from it.
"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import msgspec
from aiohttp import web

from disagg.http_edge import BadRequest, HttpError
from disagg.router.errors import sse_error_event

RESPONSES_PATH = "/v1/responses"


async def with_conversation(session: aiohttp.ClientSession, raw: bytes, decode_urls: list[str],
                            timeout_s: float, headers: dict[str, str]) -> bytes:
    """`raw` as is, unless it names a `previous_response_id`: then with the conversation one of the
    decodes stored for it (400 when none holds it)."""
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return raw  # the server answers the malformed body
    previous = body.get("previous_response_id") if isinstance(body, dict) else None
    if not isinstance(previous, str) or "disagg_conversation" in body:
        return raw
    for url in decode_urls:
        messages = await _conversation(session, url, previous, timeout_s, headers)
        if messages is not None:
            return msgspec.json.encode({**body, "disagg_conversation": messages})
    raise BadRequest(f"previous_response_id {previous!r} is not stored on any decode server", "previous_response_id")


def _not_found(response_id: str) -> bytes:
    error = {"message": f"Response with id {response_id!r} not found on any decode server.", "type": "NotFoundError",
             "param": None, "code": "response_not_found"}
    return msgspec.json.encode({"error": error})


async def _conversation(session: aiohttp.ClientSession, url: str, response_id: str, timeout_s: float,
                        headers: dict[str, str]) -> list | None:
    try:
        async with session.get(f"{url}{RESPONSES_PATH}/{response_id}/conversation", headers=headers,
                               timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            return (await r.json())["messages"] if r.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, ValueError):
        return None


async def from_holder(request: web.Request, session: aiohttp.ClientSession, decode_urls: list[str],
                      timeout_s: float, headers: dict[str, str]) -> web.StreamResponse:
    """GET (retrieve; with `?stream=true` a streamed background run's events, relayed as they come) or
    DELETE a stored Response, or POST its `/cancel`: the answer of the decode that holds it (200), else the
    first answer that was not a 404 (a cancel refused), else a 404 in OpenAI's shape."""
    follow = request.method == "GET" and request.query.get("stream", "false").lower() == "true"
    refused: tuple[int, bytes] | None = None
    for url in decode_urls:
        try:  # the answer's head within the timeout; a followed run's events may take as long as the run
            r = await asyncio.wait_for(session.request(
                request.method, url + request.path, params=request.query, headers=headers,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeout_s)), timeout_s)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            continue
        async with r:
            if r.status == 200 and follow:
                return await _relay(request, r)
            try:
                body = await asyncio.wait_for(r.read(), timeout_s)
            except (aiohttp.ClientError, asyncio.TimeoutError):
                continue
            if r.status == 200:
                return web.Response(body=body, status=200, content_type="application/json")
            if r.status != 404 and refused is None:
                refused = r.status, body
    status, body = refused or (404, _not_found(request.match_info["response_id"]))
    return web.Response(body=body, status=status, content_type="application/json")


async def _relay(request: web.Request, r: aiohttp.ClientResponse) -> web.StreamResponse:
    """A decode's event stream as it comes. Once begun, a decode that breaks off ends it with an error event
    (502); a client that left only ends it."""
    out = web.StreamResponse(status=200, headers={
        "Content-Type": r.headers.get("Content-Type", "text/event-stream"), "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no"})
    await out.prepare(request)
    try:
        async for chunk in r.content.iter_any():
            await out.write(chunk)
    except aiohttp.ClientPayloadError as exc:  # the decode broke off
        with contextlib.suppress(ConnectionError, aiohttp.ClientError):
            await out.write(sse_error_event(HttpError(502, f"decode server {r.url.origin()} broke off the stream: "
                                                           f"{exc}", code="upstream_unreachable")))
    except (ConnectionError, aiohttp.ClientError):
        return out  # the client left
    with contextlib.suppress(ConnectionError, aiohttp.ClientError):
        await out.write_eof()
    return out
