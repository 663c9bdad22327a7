"""One leg of a P/D request (the POST to the prefill or to the decode server), and running two legs
so that the first failure cancels the other at once.

Transport failures become typed errors here: a connection error is ServerUnreachable (502), a
missed deadline ServerTimeout (504), a non-2xx answer ServerError (the server's own status/body), or
ServerDraining when the server refused because it is shutting down.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import aiohttp
import msgspec

from disagg.http_edge import refusal_code
from disagg.router.errors import ServerDraining, ServerError, ServerTimeout, ServerUnreachable
from disagg.router.workers import Role
from disagg.types import ErrorCode
from disagg.wire.headers import PASSED_HEADERS


@dataclass(frozen=True)
class Leg:
    """What to send to one server: `server` is its base URL, `url` the full target."""

    role: Role
    index: int
    server: str
    url: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()  # added to the request's own (the role epoch the router saw)


@dataclass(frozen=True)
class LegAnswer:
    """A server's complete 2xx answer."""

    status: int
    content_type: str
    passed: dict[str, str]  # the answer's headers the client gets too (PASSED_HEADERS: DP rank, KV wait)
    body: bytes


@contextlib.contextmanager
def leg_errors(leg: Leg, timeout_s: float) -> Iterator[None]:
    """Turn transport failures of `leg` into ServerTimeout / ServerUnreachable."""
    try:
        yield
    except TimeoutError:  # before ClientError: aiohttp's timeouts are both
        raise ServerTimeout(str(leg.role), leg.server, timeout_s) from None
    except aiohttp.ClientError as exc:
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise ServerUnreachable(str(leg.role), leg.server, reason) from None


def answer_error(leg: Leg, resp: aiohttp.ClientResponse, raw: bytes) -> ServerError:
    """The error for a non-2xx answer: ServerDraining when the server refused because it shuts down."""
    content_type = resp.headers.get("Content-Type", "application/json")
    if (code := refusal_code(resp.status, json_or_none(raw))) is not None:
        return ServerDraining(str(leg.role), leg.index, leg.server, raw, content_type, code)
    return ServerError(str(leg.role), leg.server, resp.status, raw, content_type, resp.headers.get("Retry-After"))


def json_or_none(raw: bytes) -> object:
    """`raw` decoded as JSON, or None when it is not JSON."""
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return None


class LegClient:
    """Sends legs over the router's one ClientSession, each bounded by the request timeout."""

    def __init__(self, session: aiohttp.ClientSession, timeout_s: float, connect_timeout_s: float):
        self._session = session
        self.timeout_s = timeout_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, connect=connect_timeout_s)

    async def fetch(self, leg: Leg, headers: dict[str, str]) -> LegAnswer:
        """POST and read the whole answer; ServerError for a non-2xx status."""
        with leg_errors(leg, self.timeout_s):
            async with self._session.post(leg.url, data=leg.body, headers={**headers, **dict(leg.headers)},
                                          timeout=self._timeout) as resp:
                raw = await resp.read()
                if not 200 <= resp.status < 300:
                    raise answer_error(leg, resp, raw)
                content_type = resp.headers.get("Content-Type", "application/json")
                return LegAnswer(resp.status, content_type, passed_headers(resp.headers), raw)

    async def open_stream(self, leg: Leg, headers: dict[str, str]) -> tuple[aiohttp.ClientResponse, bytes]:
        """POST and wait for the first body chunk; the caller owns (and closes) the response."""
        with leg_errors(leg, self.timeout_s):
            resp = await self._session.post(leg.url, data=leg.body, headers={**headers, **dict(leg.headers)},
                                            timeout=self._timeout)
            try:
                if not 200 <= resp.status < 300:
                    raise answer_error(leg, resp, await resp.read())
                return resp, await resp.content.readany()
            except BaseException:
                resp.close()
                raise

    async def tokenize(self, server: str, body: dict, headers: dict[str, str]) -> list[int] | None:
        """A server's `/tokenize` of `body` (for the KV-event index); None when it cannot answer."""
        try:
            async with self._session.post(server + "/tokenize", json=body, headers=headers,
                                          timeout=self._timeout) as resp:
                answer = json_or_none(await resp.read()) if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError):
            return None
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        return tokens if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens) else None

    async def read_chunk(self, leg: Leg, resp: aiohttp.ClientResponse) -> bytes:
        """The next piece of a streamed answer; b"" at its end."""
        with leg_errors(leg, self.timeout_s):
            return await resp.content.readany()


async def cancel_all(tasks: list[asyncio.Task]) -> None:
    """Cancel `tasks` and wait until they have finished (a cancelled leg closes its connection)."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def for_its_decode(exc: BaseException | None) -> bool:
    """A prefill leg failed because its decode gave the request up (`aborted_by_decode`): the decode's
    own answer says why (a role switch's 503 a retry acts on), so it is the one to wait for."""
    if not isinstance(exc, ServerError) or exc.role != str(Role.PREFILL):
        return False
    body = json_or_none(exc.raw)
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and error.get("code") == ErrorCode.ABORTED_BY_DECODE.value


async def both_or_first_error(prefill: asyncio.Task, decode: asyncio.Task) -> tuple:
    """Both results; the first leg to fail cancels the other and its error is raised.

    If both have failed by the time we look, the prefill's error wins: it is usually the cause. A prefill
    its decode gave up (`for_its_decode`) waits for the decode's answer instead, and raises only if the
    decode answered. Cancelling the caller cancels both legs.
    """
    tasks = [prefill, decode]
    try:
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in tasks:
                if task in done and task.exception() is not None:
                    if task is prefill and for_its_decode(task.exception()) and (
                            decode in pending or decode.exception() is not None):
                        continue  # the decode's error (now, or when it comes) is the one to raise
                    raise task.exception()
        return prefill.result(), decode.result()
    finally:
        await cancel_all(tasks)


async def await_unless_other_fails(wanted: asyncio.Task, other: asyncio.Task):
    """`wanted`'s result; raises `other`'s error if it fails first (then `wanted` is cancelled).

    `other` succeeding first does not stop the wait, nor does a prefill (`other`) its decode gave up
    (`for_its_decode`): `wanted`, the decode's stream, then says how it went. (both_or_first_error, where
    both answers are read whole, raises that prefill's error if the decode answered 200 anyway.)
    """
    try:
        pending = {wanted, other}
        while wanted in pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if other in done and other.exception() is not None and not for_its_decode(other.exception()):
                raise other.exception()
        return wanted.result()
    finally:
        if not wanted.done():
            await cancel_all([wanted])


def passed_headers(upstream: Mapping[str, str]) -> dict[str, str]:
    """The headers of a server's answer that the client gets too (DP rank, the decode's KV wait)."""
    return {name: upstream[name] for name in PASSED_HEADERS if name in upstream}


def stream_headers(upstream: Mapping[str, str]) -> dict[str, str]:
    return {"Content-Type": upstream.get("Content-Type", "text/event-stream"), "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no", **passed_headers(upstream)}

