"""Async client of the bootstrap server, for prefill ranks (register) and decode workers (look up).

Every call has a deadline (`deadline_s`, default from BootstrapClientConfig) and retries with
exponential backoff until it passes: connection failures, 5xx answers and, where the server says
"not yet" (503: topology incomplete), that too. A 4xx answer is final and raises BootstrapRejected.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable

import aiohttp
import msgspec
import structlog

from disagg.config import BootstrapClientConfig
from disagg.wire.bootstrap_msgs import (
    RankAddressMsg,
    RankRegistrationMsg,
    TopologyMsg,
    dp_ranks_from_body,
    route_body,
)

Clock = Callable[[], float]
log = structlog.get_logger("bootstrap.client")


class BootstrapError(Exception):
    """Base of the bootstrap client's errors."""


class BootstrapUnavailable(BootstrapError):
    """The server could not be reached at all before the deadline (refused, reset, DNS)."""


class BootstrapTimeout(BootstrapError):
    """The server answered "not yet" (or too slowly) until the deadline passed."""


class BootstrapRejected(BootstrapError):
    """The server refused the request (4xx); retrying the same request will not help."""

    def __init__(self, status: int, message: str, url: str):
        super().__init__(f"bootstrap server {url} answered {status}: {message}")
        self.status = status
        self.message = message
        self.url = url


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
    """Talks to one bootstrap server (`http://host:port`). Use as an async context manager."""

    def __init__(
        self, host: str, port: int, config: BootstrapClientConfig = BootstrapClientConfig(),
        clock: Clock = time.monotonic,
    ):
        bracketed = f"[{host}]" if ":" in host and not host.startswith("[") else host  # IPv6
        self.url = f"http://{bracketed}:{port}"
        self.config = config
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

    async def _attempt(self, method: str, path: str, body: object | None, params: dict | None,
                       timeout_s: float) -> tuple[int, bytes]:
        data = None if body is None else msgspec.json.encode(body)
        headers = None if body is None else {"Content-Type": "application/json"}
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with self._http().request(method, self.url + path, data=data, params=params,
                                        headers=headers, timeout=timeout) as resp:
            return resp.status, await resp.read()

    async def _call(self, method: str, path: str, *, body: object | None = None,
                    params: dict | None = None, deadline_s: float | None = None) -> bytes:
        """One request, retried with backoff until a final answer or the deadline."""
        limit_s = self.config.deadline_s if deadline_s is None else deadline_s
        start = self._clock()
        reached, last, attempt = False, "no attempt made", 0
        while (remaining := start + limit_s - self._clock()) > 0:
            try:
                status, payload = await self._attempt(
                    method, path, body, params, min(self.config.request_timeout_s, remaining))
            except asyncio.TimeoutError:
                reached, last = True, "request timed out"
            except (aiohttp.ClientError, OSError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                if status == 200:
                    return payload
                if status < 500:
                    raise BootstrapRejected(status, _error_text(payload), f"{self.url}{path}")
                reached, last = True, f"HTTP {status}: {_error_text(payload)}"
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
            status, _ = await self._attempt("GET", "/health", None, None, self.config.request_timeout_s)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            return False
        return status == 200

    async def register_rank(self, reg: RankRegistrationMsg, deadline_s: float | None = None) -> None:
        """PUT /route for one prefill rank; retried until the server is up or the deadline."""
        await self._call("PUT", "/route", body=route_body(reg), deadline_s=deadline_s)

    async def get_topology(self, deadline_s: float | None = None) -> TopologyMsg:
        """The prefill server's topology; waits (503 retried) until every rank registered."""
        params = {"engine_rank": "-1", "target_dp_group": "-1", "target_pp_rank": "-1"}
        raw = await self._call("GET", "/route", params=params, deadline_s=deadline_s)
        return msgspec.json.decode(raw, type=TopologyMsg)

    async def get_rank_address(self, dp_rank: int, tp_rank: int = 0, pp_rank: int = 0, cp_rank: int = 0,
                               deadline_s: float | None = None) -> RankAddressMsg:
        """Where one prefill rank's control plane listens; BootstrapRejected(404) if no such rank."""
        params = {"prefill_dp_rank": str(dp_rank), "prefill_cp_rank": str(cp_rank),
                  "target_tp_rank": str(tp_rank), "target_pp_rank": str(pp_rank)}
        raw = await self._call("GET", "/route", params=params, deadline_s=deadline_s)
        return msgspec.json.decode(raw, type=RankAddressMsg)

    async def register_dp_rank(self, room: int, dp_rank: int, deadline_s: float | None = None) -> None:
        """POST /register_dp_rank: prefill DP rank `dp_rank` serves `room`."""
        body = {"bootstrap_room": room, "dp_rank": dp_rank}
        await self._call("POST", "/register_dp_rank", body=body, deadline_s=deadline_s)

    async def _post_query(self, rooms: list[int]) -> dict[int, int]:
        raw = await self._call("POST", "/query_dp_ranks", body={"bootstrap_rooms": rooms})
        return dp_ranks_from_body(raw)

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
