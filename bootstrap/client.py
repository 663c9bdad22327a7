"""Async client of the bootstrap server, for prefill ranks (register) and decode workers (look up).

Every call has a deadline (`deadline_s`, default from BootstrapClientConfig) and retries with
exponential backoff until it passes: connection failures, 5xx answers and, where the server says
"not yet" (503: topology incomplete), that too. A 4xx answer is final and raises BootstrapRejected.

A decode reaches whatever bootstrap_host a request names, so errors never carry the server's response
text: they say which host:port answered which status (the text goes to the log only). The cluster
secret is proved on the write calls only (PUT /route, POST /register_dp_rank: `GET /challenge`, then
the write with a proof answering it), never on reads; the secret itself is never sent.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Iterable

import aiohttp
import msgspec
import structlog

from disagg.registry_config import BootstrapClientConfig
from disagg.wire.auth import NONCE_BYTES, REGISTRY, Binding, answer, format_address, request_digest
from disagg.wire.bootstrap_msgs import (
    ChallengeMsg,
    RankAddressMsg,
    RankRegistrationMsg,
    TopologyMsg,
    dp_ranks_from_body,
    route_body,
)
from disagg.wire.headers import CLUSTER_AUTH_HEADER

Clock = Callable[[], float]
log = structlog.get_logger("bootstrap.client")


class BootstrapError(Exception):
    """Base of the bootstrap client's errors."""


class BootstrapUnavailable(BootstrapError):
    """The server could not be reached at all before the deadline (refused, reset, DNS)."""


class BootstrapTimeout(BootstrapError):
    """The server answered "not yet" (or too slowly) until the deadline passed."""


_HINTS = {401: ": the cluster secret is missing or differs from the registry's",
          429: ": the registry holds as many rooms as its --max-rooms allows"}


class BootstrapRejected(BootstrapError):
    """The server refused the request (4xx); retrying the same request will not help.

    The message names the server, the call and the status; `detail` holds the server's own error
    text, for logs only (it is the remote body, never shown to a client)."""

    def __init__(self, status: int, address: str, call: str, detail: str):
        hint = _HINTS.get(status, "")
        super().__init__(f"bootstrap server {address} answered {status} to {call}{hint}")
        self.status = status
        self.address = address
        self.detail = detail


class BootstrapInvalidAnswer(BootstrapError):
    """The server answered 200 with a body that is not what the call expects (not a bootstrap server?)."""


def _transport_failure(exc: BaseException) -> str:
    """What went wrong reaching the server, without anything the server sent (a parser error quotes
    the bytes of a non-HTTP answer: a banner is a remote body too)."""
    if isinstance(exc, OSError):  # connect failures: our own socket's view
        return f"{type(exc).__name__}: {exc}"
    return type(exc).__name__


def _error_text(body: bytes) -> str:
    try:
        decoded = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return body.decode(errors="replace")[:500]
    return str(decoded.get("error", decoded)) if isinstance(decoded, dict) else str(decoded)


class _RoomQueryBatcher:
    """Coalesces concurrent room queries arriving within `window_s` into one POST."""

    def __init__(self, send: Callable[[list[int]], Awaitable[dict[int, int]]], window_s: float):
        self._send = send
        self._window_s = window_s
        self._waiting: list[tuple[list[int], asyncio.Future]] = []
        self._flush: asyncio.Task | None = None

    async def query(self, rooms: list[int]) -> dict[int, int]:
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((rooms, future))
        if self._flush is None:
            self._flush = asyncio.create_task(self._flush_after_window())
        return await future

    async def _flush_after_window(self) -> None:
        await asyncio.sleep(self._window_s)
        waiting, self._waiting, self._flush = self._waiting, [], None
        rooms = sorted({room for batch, _ in waiting for room in batch})
        try:
            found = await self._send(rooms)
        except Exception as exc:  # handed to every caller of this batch, none is lost
            for _, future in waiting:
                if not future.done():
                    future.set_exception(exc)
            return
        for batch, future in waiting:
            if not future.done():
                future.set_result({room: found[room] for room in batch if room in found})

    def close(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
        for _, future in self._waiting:
            if not future.done():
                future.set_exception(BootstrapUnavailable("bootstrap client closed"))
        self._waiting, self._flush = [], None


class BootstrapClient:
    """Talks to one bootstrap server (`http://host:port`). Use as an async context manager.

    With `cluster_secret`, writes prove it as `identity` (a prefill passes its transfer agent's name)."""

    def __init__(
        self, host: str, port: int, config: BootstrapClientConfig = BootstrapClientConfig(),
        clock: Clock = time.monotonic, *, cluster_secret: str | None = None, identity: str = "prefill",
    ):
        self.address = format_address(host, port)  # also the target our proofs name
        self.url = f"http://{self.address}"
        self.config = config
        self.identity = identity
        self._cluster_secret = cluster_secret
        self._clock = clock
        self._session: aiohttp.ClientSession | None = None
        self._batcher = _RoomQueryBatcher(self._post_query, config.query_batch_window_s)

    async def __aenter__(self) -> BootstrapClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the HTTP session; idempotent."""
        self._batcher.close()
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    async def _request(self, method: str, path: str, data: bytes | None, params: dict | None,
                       headers: dict[str, str] | None, timeout_s: float) -> tuple[int, bytes]:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with self._http().request(method, self.url + path, data=data, params=params,
                                        headers=headers, timeout=timeout) as resp:
            return resp.status, await resp.read()

    async def _attempt(self, method: str, path: str, body: object | None, params: dict | None,
                       write: bool) -> tuple[str, int, bytes]:
        """One attempt: (the call that answered, its status, its body). A write, when we hold a cluster
        secret, first takes a challenge and then carries the proof answering it."""
        data = None if body is None else msgspec.json.encode(body)
        headers = {} if body is None else {"Content-Type": "application/json"}
        timeout_s = self.config.request_timeout_s
        if write and self._cluster_secret is not None:
            status, payload = await self._request("GET", "/challenge", None, None, None, timeout_s)
            if status != 200:
                return "GET /challenge", status, payload
            headers[CLUSTER_AUTH_HEADER] = self._proof(method, path, data or b"", payload)
        status, payload = await self._request(method, path, data, params, headers or None, timeout_s)
        return f"{method} {path}", status, payload

    def _proof(self, method: str, path: str, data: bytes, challenge: bytes) -> str:
        """Our answer to the registry's challenge for this very write."""
        try:
            nonce = bytes.fromhex(msgspec.json.decode(challenge, type=ChallengeMsg).nonce)
        except (msgspec.DecodeError, ValueError):  # the messages quote the body: they stay out
            raise BootstrapInvalidAnswer(f"bootstrap server {self.address} answered 200 to GET /challenge with a "
                                         "body that is not a ChallengeMsg") from None
        binding = Binding(nonce, os.urandom(NONCE_BYTES), self.identity, self.address,
                          request_digest(method, path, data))
        return answer(self._cluster_secret, REGISTRY, binding)

    async def _call(self, method: str, path: str, *, body: object | None = None, params: dict | None = None,
                    deadline_s: float | None = None, write: bool = False) -> bytes:
        """One request, retried with backoff until a final answer or the deadline. `write` calls prove
        the cluster secret."""
        limit_s = self.config.deadline_s if deadline_s is None else deadline_s
        start = self._clock()
        reached, last, attempt = False, "no attempt made", 0
        while (remaining := start + limit_s - self._clock()) > 0:
            try:
                call, status, payload = await asyncio.wait_for(
                    self._attempt(method, path, body, params, write), min(self.config.request_timeout_s, remaining))
            except asyncio.TimeoutError:
                # Cut by our own deadline, not the request timeout: what the server said before says more.
                if remaining >= self.config.request_timeout_s or attempt == 0:
                    reached, last = True, "request timed out"
            except (aiohttp.ClientError, OSError) as exc:
                last = _transport_failure(exc)
            else:
                if status == 200:
                    return payload
                if status < 500:
                    detail = _error_text(payload)
                    log.warning("bootstrap request refused", server=self.address, call=call, status=status,
                                detail=detail)
                    raise BootstrapRejected(status, self.address, call, detail)
                reached, last = True, f"HTTP {status}"
                log.debug("bootstrap request not answered yet", server=self.address, call=call, status=status,
                          detail=_error_text(payload))
            delay = min(self.config.retry.backoff_s(attempt), max(0.0, start + limit_s - self._clock()))
            attempt += 1
            await asyncio.sleep(delay)
        elapsed = self._clock() - start
        kind = BootstrapTimeout if reached else BootstrapUnavailable
        raise kind(
            f"bootstrap server {self.url}: {method} {path} got no answer within {limit_s:g} s "
            f"(elapsed {elapsed:.2f} s, {attempt} attempts; last: {last})"
        )

    async def health(self) -> bool:
        """True if the server answers GET /health with 200 within one request timeout."""
        try:
            status, _ = await self._request("GET", "/health", None, None, None, self.config.request_timeout_s)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            return False
        return status == 200

    async def register_rank(self, reg: RankRegistrationMsg, deadline_s: float | None = None) -> None:
        """PUT /route for one prefill rank; retried until the server is up or the deadline."""
        await self._call("PUT", "/route", body=route_body(reg), deadline_s=deadline_s, write=True)

    async def get_topology(self, deadline_s: float | None = None) -> TopologyMsg:
        """The prefill server's topology; waits (503 retried) until every rank registered."""
        params = {"engine_rank": "-1", "target_dp_group": "-1", "target_pp_rank": "-1"}
        raw = await self._call("GET", "/route", params=params, deadline_s=deadline_s)
        return self._decode(raw, TopologyMsg, "GET /route")

    async def get_rank_address(self, dp_rank: int, tp_rank: int = 0, pp_rank: int = 0, cp_rank: int = 0,
                               deadline_s: float | None = None) -> RankAddressMsg:
        """Where one prefill rank's control plane listens; BootstrapRejected(404) if no such rank."""
        params = {"prefill_dp_rank": str(dp_rank), "prefill_cp_rank": str(cp_rank),
                  "target_tp_rank": str(tp_rank), "target_pp_rank": str(pp_rank)}
        raw = await self._call("GET", "/route", params=params, deadline_s=deadline_s)
        return self._decode(raw, RankAddressMsg, "GET /route")

    def _decode(self, raw: bytes, kind: type, call: str):
        try:
            return msgspec.json.decode(raw, type=kind)
        except msgspec.DecodeError:  # ValidationError too; its text may quote the body, so it stays out
            raise BootstrapInvalidAnswer(
                f"bootstrap server {self.address} answered 200 to {call} with a body that is not a "
                f"{kind.__name__}") from None

    async def register_dp_rank(self, room: int, dp_rank: int, deadline_s: float | None = None) -> None:
        """POST /register_dp_rank: prefill DP rank `dp_rank` serves `room`."""
        body = {"bootstrap_room": room, "dp_rank": dp_rank}
        await self._call("POST", "/register_dp_rank", body=body, deadline_s=deadline_s, write=True)

    async def _post_query(self, rooms: list[int]) -> dict[int, int]:
        raw = await self._call("POST", "/query_dp_ranks", body={"bootstrap_rooms": rooms})
        try:
            return dp_ranks_from_body(raw)
        except (msgspec.DecodeError, ValueError):  # the messages quote the body: they stay out
            raise BootstrapInvalidAnswer(f"bootstrap server {self.address} answered 200 to POST /query_dp_ranks "
                                         "with a body that is not a room map") from None

    async def query_dp_ranks(self, rooms: Iterable[int]) -> dict[int, int]:
        """room -> prefill DP rank for the rooms the server knows now (others are left out).

        Concurrent calls within `query_batch_window_s` share one POST.
        """
        rooms = list(rooms)
        return await self._batcher.query(rooms) if rooms else {}

    async def wait_for_dp_rank(self, room: int, deadline_s: float | None = None) -> int:
        """Poll until the room is registered (the prefill may register after we ask)."""
        limit_s = self.config.deadline_s if deadline_s is None else deadline_s
        start, attempt = self._clock(), 0
        while (remaining := start + limit_s - self._clock()) > 0:
            try:
                found = await asyncio.wait_for(self.query_dp_ranks([room]), remaining)
            except asyncio.TimeoutError:
                break
            if room in found:
                return found[room]
            delay = min(self.config.retry.backoff_s(attempt), max(0.0, start + limit_s - self._clock()))
            attempt += 1
            await asyncio.sleep(delay)
        raise BootstrapTimeout(
            f"bootstrap server {self.url}: room {room} not registered within {limit_s:g} s "
            f"(elapsed {self._clock() - start:.2f} s, {attempt} queries answered)"
        )
