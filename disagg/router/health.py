"""Background health checks (`GET /health` of every server) and what `/server_info` tells: the DP
size, a decode's local-prefill limit, and for a server that may switch roles (`pd_role_epoch`) its
role now: a server that switched moves to its new role in the pool.

Results go into the WorkerPool; the policy then skips unhealthy servers. Every probe has its own
deadline (`health_check_timeout_s`), so one hung server never delays the others. A server that
refused a request because it switches roles is watched closely (`watch`: a check every 0.25 s)
until it serves again, in whichever role.
"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import msgspec
import structlog

from disagg.http_edge import HttpError, refusal_code
from disagg.router.config import RouterConfig
from disagg.router.errors import ServerTimeout, ServerUnreachable
from disagg.router.legs import json_or_none
from disagg.router.workers import Health, Role, WorkerPool

log = structlog.get_logger("disagg.router")
SERVER_INFO_PATHS = ("/server_info", "/get_server_info")
ROLE_WATCH_INTERVAL_S = 0.25  # a switching server is checked this often ...
ROLE_WATCH_LIMIT_S = 300.0  # ... for at most this long (a switch waits up to its server's timeout, 60 s by default)


async def probe_health(session: aiohttp.ClientSession, url: str, timeout_s: float) -> str | None:
    """None if `GET url/health` answers 2xx within the deadline, else why not."""
    try:
        async with session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            raw = await resp.read()
            if 200 <= resp.status < 300:
                return None
            code = refusal_code(resp.status, json_or_none(raw))
            return f"/health answered {resp.status}" + ("" if code is None else f" ({code.value})")
    except asyncio.TimeoutError:
        return f"/health did not answer within {timeout_s:g} s"
    except aiohttp.ClientError as exc:
        return f"/health failed: {type(exc).__name__}: {exc}"


def local_prefill_limit_of(info: object) -> int:
    """A decode's `max_local_prefill_tokens` from a /server_info answer (0: none, or not ours)."""
    limit = info.get("max_local_prefill_tokens") if isinstance(info, dict) else None
    return limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else 0


def switch_facts_of(info: object) -> tuple[int | None, Role | None, int | None]:
    """(pd_role_epoch, the role it serves now, its registry's port) of a server that may switch roles;
    (None, None, None) for one that cannot."""
    if not isinstance(info, dict) or not isinstance(info.get("pd_role_epoch"), int):
        return None, None, None
    mode = info.get("disaggregation_mode")
    port = info.get("disaggregation_bootstrap_port")
    return (info["pd_role_epoch"], Role(mode) if mode in (Role.PREFILL.value, Role.DECODE.value) else None,
            port if isinstance(port, int) else None)


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
        self._roles_task: asyncio.Task | None = None
        self._watched: dict[str, asyncio.Task] = {}  # url -> the task watching it switch roles

    async def start(self) -> None:
        """One round of checks (so the first requests see real health), then the background loops."""
        if self._config.role_poll_interval_s > 0:
            self._roles_task = asyncio.create_task(self._roles_loop(), name="router-role-reads")
        if not self._config.health_checks_enabled:
            return
        await self.check_all()
        self._task = asyncio.create_task(self._loop(), name="router-health-checks")

    async def close(self) -> None:
        """Stop the background loop; idempotent."""
        tasks = [t for t in (self._task, self._roles_task, *self._watched.values()) if t is not None]
        self._task, self._roles_task, self._watched = None, None, {}
        for task in tasks:
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
        return await self.read_server_info(role, index)

    async def read_server_info(self, role: Role, index: int) -> int:
        """Read the server's /server_info into the pool: a server that switched roles moves to its
        new one. Its dp_size."""
        url = self._pool.info(role, index).url
        answer = await fetch_server_info(self._session, role, url, self._config.health_check_timeout_s)
        epoch, mode, bootstrap_port = switch_facts_of(answer)
        if mode is not None and mode is not role:
            moved = self._pool.move(role, index, mode, bootstrap_port)
            log.info("server switched role", url=url, role=str(mode), pd_role_epoch=epoch)
            if moved is None:
                return dp_size_of(answer)
            role, index = mode, moved
        dp_size, limit = dp_size_of(answer), local_prefill_limit_of(answer) if role is Role.DECODE else 0
        known = self._pool.info(role, index)
        if (known.dp_size, known.role_epoch) != (dp_size, epoch):
            log.info("server info read", role=str(role), url=url, dp_size=dp_size, max_local_prefill_tokens=limit,
                     pd_role_epoch=epoch)
        record = answer.get("kv_compatibility") if isinstance(answer, dict) else None
        self._pool.set_dp_size(role, index, dp_size, limit, epoch, record if isinstance(record, dict) else None)
        return dp_size

    def watch(self, role: Role, index: int) -> None:
        """The server refused a request because it switches roles (or it was sent one for a role it
        left): check it every ROLE_WATCH_INTERVAL_S until it serves again, then follow its role."""
        if not self._pool.contains(role, index):
            return
        url = self._pool.info(role, index).url
        if url not in self._watched:
            self._watched[url] = asyncio.create_task(self._watch(role, index, url), name=f"router-watch-{url}")

    async def _watch(self, role: Role, index: int, url: str) -> None:
        try:
            deadline = asyncio.get_running_loop().time() + ROLE_WATCH_LIMIT_S
            while asyncio.get_running_loop().time() < deadline and self._pool.contains(role, index):
                await asyncio.sleep(ROLE_WATCH_INTERVAL_S)
                if await self.check(role, index, read_info=True) is Health.HEALTHY:
                    return
        finally:
            self._watched.pop(url, None)

    async def ensure_server_infos(self, role: Role) -> None:
        """Read /server_info of every admitting server of `role` not read yet (cache_aware reads the
        decodes' local-prefill limits before its first pick, health checks on or off); a server that
        does not answer is read again on the next call."""
        unread = [info.index for info in self._pool.infos(role)
                  if info.admitting and info.dp_size is None and info.health is not Health.UNHEALTHY]
        if unread:
            await asyncio.gather(*(self._read_quietly(role, index) for index in unread))

    async def _read_quietly(self, role: Role, index: int, again: bool = False) -> None:
        """The server's /server_info if not read yet (`again`: anyway); a server that does not answer is
        left as it is (its health check tells)."""
        with contextlib.suppress(HttpError, KeyError):
            await (self.read_server_info(role, index) if again else self.ensure_dp_size(role, index))

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._config.health_check_interval_s)
            await self.check_all()

    async def _roles_loop(self) -> None:
        """Every `role_poll_interval_s`: the role of each server that may switch roles (its /server_info)."""
        while True:
            await asyncio.sleep(self._config.role_poll_interval_s)
            switchable = [(info.role, info.index) for role in Role for info in self._pool.infos(role)
                          if info.admitting and info.role_epoch is not None]
            await asyncio.gather(*(self._read_quietly(role, index, again=True) for role, index in switchable))

    async def check(self, role: Role, index: int, read_info: bool = False) -> Health | None:
        """Probe one server now and record the outcome; None if it was forgotten meanwhile. A healthy
        server's /server_info is read the first time, on every check when it may switch roles, and
        with `read_info`."""
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
        known = self._pool.info(role, index)
        if health is Health.HEALTHY and (read_info or known.dp_size is None or known.role_epoch is not None):
            with contextlib.suppress(HttpError, KeyError):  # read lazily per request instead
                await self.read_server_info(role, index)
        return health
