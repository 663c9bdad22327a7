"""Background health checks (`GET /health` of every server) and DP-size discovery (`/server_info`).

Results go into the WorkerPool; the policy then skips unhealthy servers. Every probe has its own
deadline (`health_check_timeout_s`), so one hung server never delays the others.
"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import msgspec
import structlog

from disagg.http_edge import HttpError, is_draining_answer
from disagg.router.config import RouterConfig
from disagg.router.errors import ServerTimeout, ServerUnreachable
from disagg.router.legs import json_or_none
from disagg.router.policy import Policy
from disagg.router.workers import Health, Role, WorkerPool

log = structlog.get_logger("disagg.router")
SERVER_INFO_PATHS = ("/server_info", "/get_server_info")


async def probe_health(session: aiohttp.ClientSession, url: str, timeout_s: float) -> str | None:
    """None if `GET url/health` answers 2xx within the deadline, else why not."""
    try:
        async with session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            raw = await resp.read()
            if 200 <= resp.status < 300:
                return None
            draining = is_draining_answer(resp.status, json_or_none(raw))
            return f"/health answered {resp.status}" + (" (draining)" if draining else "")
    except asyncio.TimeoutError:
        return f"/health did not answer within {timeout_s:g} s"
    except aiohttp.ClientError as exc:
        return f"/health failed: {type(exc).__name__}: {exc}"


def local_prefill_limit_of(info: object) -> int:
    """A decode's `max_local_prefill_tokens` from a /server_info answer (0: none, or not ours)."""
    limit = info.get("max_local_prefill_tokens") if isinstance(info, dict) else None
    return limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else 0


def dp_size_of(info: object) -> int:
    """`dp_size` from a /server_info answer; else the number of `internal_states`; else 1."""
    if isinstance(info, dict):
        size = info.get("dp_size")
        if isinstance(size, int) and not isinstance(size, bool) and size >= 1:
            return size
        states = info.get("internal_states")
        if isinstance(states, list) and states:
            return len(states)
    return 1


async def fetch_server_info(session: aiohttp.ClientSession, role: Role, url: str, timeout_s: float) -> object:
    """The server's `/server_info` answer (or SGLang's older `/get_server_info`)."""
    last = "no answer"
    for path in SERVER_INFO_PATHS:
        try:
            async with session.get(url + path, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                raw = await resp.read()
                if resp.status == 200:
                    return msgspec.json.decode(raw)
                last = f"{path} answered {resp.status}"
        except asyncio.TimeoutError:
            raise ServerTimeout(str(role), url, timeout_s) from None
        except aiohttp.ClientError as exc:
            raise ServerUnreachable(str(role), url, f"{type(exc).__name__}: {exc}") from None
        except msgspec.DecodeError:
            last = f"{path} answered invalid JSON"
    raise HttpError(502, f"cannot read dp_size of {role} server {url}: {last}", code="dp_size_unknown")


class HealthChecker:
    """Checks every server once at start, then every `health_check_interval_s` until closed."""

    def __init__(self, config: RouterConfig, pool: WorkerPool, session: aiohttp.ClientSession):
        self._config = config
        self._pool = pool
        self._session = session
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """One round of checks (so the first requests see real health), then the background loop."""
        if not self._config.health_checks_enabled:
            return
        await self.check_all()
        self._task = asyncio.create_task(self._loop(), name="router-health-checks")

    async def close(self) -> None:
        """Stop the background loop; idempotent."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def check_all(self) -> None:
        """Check every server of both roles that admits requests, concurrently."""
        checks = [self.check(info.role, info.index) for role in Role for info in self._pool.infos(role)
                  if info.admitting]
        await asyncio.gather(*checks)

    async def ensure_dp_size(self, role: Role, index: int) -> int:
        """The server's dp_size, read from its /server_info the first time it is needed (with a
        decode's local-prefill limit)."""
        info = self._pool.info(role, index)
        if info.dp_size is not None:
            return info.dp_size
        answer = await fetch_server_info(self._session, role, info.url, self._config.health_check_timeout_s)
        dp_size, limit = dp_size_of(answer), local_prefill_limit_of(answer) if role is Role.DECODE else 0
        self._pool.set_dp_size(role, index, dp_size, limit)
        log.info("server info read", role=str(role), url=info.url, dp_size=dp_size, max_local_prefill_tokens=limit)
        return dp_size

    async def ensure_server_infos(self, role: Role) -> None:
        """Read /server_info of every admitting server of `role` not read yet (cache_aware reads the
        decodes' local-prefill limits before its first pick, health checks on or off); a server that
        does not answer is read again on the next call."""
        unread = [info.index for info in self._pool.infos(role)
                  if info.admitting and info.dp_size is None and info.health is not Health.UNHEALTHY]
        if unread:
            await asyncio.gather(*(self._read_quietly(role, index) for index in unread))

    async def _read_quietly(self, role: Role, index: int) -> None:
        with contextlib.suppress(HttpError, KeyError):
            await self.ensure_dp_size(role, index)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._config.health_check_interval_s)
            await self.check_all()

    def _needs_dp_size(self, role: Role) -> bool:
        """The test mode pins ranks on both roles; cache_aware keeps a tree per prefill DP rank and
        reads each decode's local-prefill limit."""
        return self._config.test_external_dp_routing or self._config.policy is Policy.CACHE_AWARE

    async def check(self, role: Role, index: int) -> Health | None:
        """Probe one server now and record the outcome; None if it was forgotten meanwhile."""
        if not self._pool.contains(role, index):
            return None
        url = self._pool.info(role, index).url
        error = await probe_health(self._session, url, self._config.health_check_timeout_s)
        health = Health.HEALTHY if error is None else Health.UNHEALTHY
        previous = self._pool.set_health(role, index, health, error)
        if previous is None:
            return None
        if health is not previous:
            report = log.info if health is Health.HEALTHY else log.warning
            report("server health changed", role=str(role), url=url, health=str(health), reason=error)
        if health is Health.HEALTHY and self._needs_dp_size(role):
            with contextlib.suppress(HttpError, KeyError):  # read lazily per request instead
                await self.ensure_dp_size(role, index)
        return health
