"""The router's view of its servers: health, requests in flight and DP size, per role.

Pure bookkeeping (no I/O): the health checker and the proxy report into it; the policy reads
`loads()` from it; `/server_info` and `/workers` list `infos()`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from disagg.router.config import PrefillEndpoint
from disagg.router.policy import ServerLoad


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"

    def __str__(self) -> str:
        return self.value


class Health(str, enum.Enum):
    UNKNOWN = "unknown"  # not checked yet: still eligible, but /health does not count it
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"  # skipped by the policy until a check succeeds again
    PENDING = "pending"  # discovered, not checked yet: not eligible until the router's own check succeeds

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class WorkerInfo:
    """A snapshot of one server, for listings and for the proxy."""

    role: Role
    index: int  # the server's id in its role (WorkerPool)
    url: str
    bootstrap_port: int | None
    health: Health
    in_flight: int
    dp_size: int | None
    last_error: str | None
    admitting: bool = True
    prefilling: int = 0  # prefill servers: legs sent that have not answered
    role_epoch: int | None = None  # a server that may switch roles: its pd_role_epoch when last read
    compatibility: dict | None = None  # its /server_info kv_compatibility (disagg/router/compat.py)
    registry_host: str | None = None  # a prefill's standalone bootstrap registry (None: on the server's host)

    def as_json(self) -> dict:
        """The entry of this server in `/server_info` and `/workers`."""
        out = {"url": self.url, "role": self.role.value, "health": self.health.value,
               "healthy": self.health is Health.HEALTHY, "in_flight": self.in_flight, "dp_size": self.dp_size,
               "last_error": self.last_error}
        if not self.admitting:
            out["draining"] = True
        if self.role is Role.PREFILL:
            out["bootstrap_port"] = self.bootstrap_port
            if self.registry_host is not None:
                out["bootstrap_host"] = self.registry_host
        if self.role_epoch is not None:
            out["pd_role_epoch"] = self.role_epoch
        return out


@dataclass
class _Worker:
    url: str
    bootstrap_port: int | None
    health: Health
    in_flight: int = 0
    dp_size: int | None = None
    last_error: str | None = None
    admitting: bool = True  # False once drained: no new requests, those in flight finish
    prefilling: int = 0  # of in_flight, those whose prefill leg has not answered yet
    max_local_prefill_tokens: int = 0  # decode servers: from /server_info, read with dp_size
    role_epoch: int | None = None  # from /server_info: a server that may switch roles (None: it cannot)
    compatibility: dict | None = None  # from /server_info: what a peer must share (None: not said)
    registry_host: str | None = None  # a prefill registering with a standalone registry (--prefill URL HOST:PORT)


class WorkerPool:
    """Every prefill and decode server of one router, addressed by (role, id).

    Ids are given in order of arrival and never reused: the static servers of the command line get
    0, 1, ... in their order; servers found by discovery are added (`add`), drained (`drain`: no new
    requests) and forgotten once drained and idle, so an id held by a request in flight stays valid.
    """

    def __init__(self, prefill: Sequence[PrefillEndpoint], decode: Sequence[str], initial: Health = Health.UNKNOWN):
        self._workers: dict[Role, dict[int, _Worker]] = {Role.PREFILL: {}, Role.DECODE: {}}
        self._next_id = {Role.PREFILL: 0, Role.DECODE: 0}
        self.on_forget: Callable[[Role, str], None] | None = None  # (role, url) of a server forgotten
        for p in prefill:
            self._workers[Role.PREFILL][self.add(Role.PREFILL, p.url, p.bootstrap_port, initial)].registry_host = \
                p.registry_host
        for url in decode:
            self.add(Role.DECODE, url, None, initial)

    def add(self, role: Role, url: str, bootstrap_port: int | None, health: Health = Health.PENDING) -> int:
        """A new server of `role`; returns its id. Discovered servers start PENDING: not eligible
        until the router's own health check succeeds."""
        worker_id = self._next_id[role]
        self._next_id[role] += 1
        self._workers[role][worker_id] = _Worker(url, bootstrap_port, health)
        return worker_id

    def drain(self, role: Role, worker_id: int) -> bool:
        """Stop sending new requests to the server; it is forgotten once its requests in flight end.
        Returns True if it is already gone (nothing was in flight)."""
        w = self._workers[role].get(worker_id)
        if w is None:
            return True
        w.admitting = False
        return self._forget_if_drained(role, worker_id)

    def readmit(self, role: Role, worker_id: int) -> None:
        """A draining server is wanted again: it admits once a fresh health check succeeds."""
        w = self._workers[role][worker_id]
        w.admitting, w.health = True, Health.PENDING

    def ids(self, role: Role) -> list[int]:
        """The ids of every server of `role` (draining ones too), in order of arrival."""
        return list(self._workers[role])

    def contains(self, role: Role, worker_id: int) -> bool:
        """Whether the server is still known (drained servers are forgotten once idle)."""
        return worker_id in self._workers[role]

    def size(self, role: Role) -> int:
        """How many servers of `role` the router knows (draining ones included)."""
        return len(self._workers[role])

    def loads(self, role: Role) -> list[ServerLoad]:
        """What the policy sees, in the order of `ids(role)`: unhealthy, unchecked discovered and
        draining servers are not eligible."""
        return [ServerLoad(_eligible(w), w.in_flight, i, w.dp_size, w.prefilling, w.max_local_prefill_tokens)
                for i, w in self._workers[role].items()]

    def info(self, role: Role, worker_id: int) -> WorkerInfo:
        """A snapshot of one server."""
        w = self._workers[role][worker_id]
        return WorkerInfo(role, worker_id, w.url, w.bootstrap_port, w.health, w.in_flight, w.dp_size, w.last_error,
                          w.admitting, w.prefilling, w.role_epoch, w.compatibility, w.registry_host)

    def infos(self, role: Role) -> list[WorkerInfo]:
        """Snapshots of every server of `role`, in order of arrival."""
        return [self.info(role, i) for i in self._workers[role]]

    def num_healthy(self, role: Role) -> int:
        """Servers that admit requests and whose last health check succeeded."""
        return sum(w.admitting and w.health is Health.HEALTHY for w in self._workers[role].values())

    def first_eligible(self, role: Role) -> int | None:
        """The first server the policy could pick (healthy first, then not-yet-checked)."""
        workers = self._workers[role]
        for wanted in (Health.HEALTHY, Health.UNKNOWN):
            for i, w in workers.items():
                if w.admitting and w.health is wanted:
                    return i
        return None

    def set_health(self, role: Role, worker_id: int, health: Health, error: str | None = None) -> Health | None:
        """Record a check's outcome; returns the previous state (callers log transitions), or None
        when the server was forgotten while it was being checked."""
        w = self._workers[role].get(worker_id)
        if w is None:
            return None
        previous, w.health = w.health, health
        w.last_error = error if health is Health.UNHEALTHY else None
        return previous

    def set_dp_size(self, role: Role, worker_id: int, dp_size: int, max_local_prefill_tokens: int = 0,
                    role_epoch: int | None = None, compatibility: dict | None = None) -> None:
        """Record what the server reported in `/server_info`: its dp_size, (a decode) the rest it
        prefills itself, (a server that may switch roles) its role epoch, and its compatibility record."""
        if dp_size < 1:
            raise ValueError(f"dp_size must be at least 1, got {dp_size}")
        w = self._workers[role].get(worker_id)
        if w is not None:
            w.dp_size, w.max_local_prefill_tokens, w.role_epoch = dp_size, max_local_prefill_tokens, role_epoch
            w.compatibility = compatibility

    def move(self, role: Role, worker_id: int, new_role: Role, bootstrap_port: int | None) -> int | None:
        """The server switched to `new_role`: it drains in `role` (its requests there finish; it is
        forgotten once idle) and serves in `new_role` (its entry there again if it had one); its id
        in `new_role`, or None when it was forgotten meanwhile. Its server info is read again."""
        w = self._workers[role].get(worker_id)
        if w is None:
            return None
        w.admitting = False
        self._forget_if_drained(role, worker_id)
        for other_id, other in self._workers[new_role].items():
            if other.url == w.url:
                other.admitting, other.health, other.bootstrap_port, other.dp_size = True, Health.HEALTHY, bootstrap_port, None
                return other_id
        return self.add(new_role, w.url, bootstrap_port, Health.HEALTHY)

    def begin(self, role: Role, worker_id: int) -> None:
        """A request starts on this server."""
        self._workers[role][worker_id].in_flight += 1

    def end(self, role: Role, worker_id: int) -> None:
        """A request on this server is over (answered, failed or cancelled); a drained server
        whose last request ended is forgotten."""
        w = self._workers[role][worker_id]
        assert w.in_flight > 0, f"{role} server {w.url}: request ended twice"
        w.in_flight -= 1
        self._forget_if_drained(role, worker_id)

    def begin_prefill(self, worker_id: int) -> None:
        """A prefill leg is sent to this prefill server (its request has begun there)."""
        self._workers[Role.PREFILL][worker_id].prefilling += 1

    def end_prefill(self, worker_id: int) -> None:
        """That prefill leg answered, failed or was cancelled (a server forgotten meanwhile is skipped)."""
        w = self._workers[Role.PREFILL].get(worker_id)
        if w is not None:
            w.prefilling -= 1

    def _forget_if_drained(self, role: Role, worker_id: int) -> bool:
        w = self._workers[role][worker_id]
        if w.admitting or w.in_flight:
            return False
        del self._workers[role][worker_id]
        if self.on_forget is not None and all(other.url != w.url for other in self._workers[role].values()):
            self.on_forget(role, w.url)
        return True


def _eligible(w: _Worker) -> bool:
    return w.admitting and w.health not in (Health.UNHEALTHY, Health.PENDING)
