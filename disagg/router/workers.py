"""The router's view of its servers: health, requests in flight and DP size, per role.

Pure bookkeeping (no I/O): the health checker and the proxy report into it; the policy reads
`loads()` from it; `/server_info` and `/workers` list `infos()`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
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

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class WorkerInfo:
    """A snapshot of one server, for listings and for the proxy."""

    role: Role
    index: int
    url: str
    bootstrap_port: int | None
    health: Health
    in_flight: int
    dp_size: int | None
    last_error: str | None

    def as_json(self) -> dict:
        """The entry of this server in `/server_info` and `/workers`."""
        out = {"url": self.url, "role": self.role.value, "health": self.health.value,
               "healthy": self.health is Health.HEALTHY, "in_flight": self.in_flight, "dp_size": self.dp_size,
               "last_error": self.last_error}
        if self.role is Role.PREFILL:
            out["bootstrap_port"] = self.bootstrap_port
        return out


@dataclass
class _Worker:
    url: str
    bootstrap_port: int | None
    health: Health
    in_flight: int = 0
    dp_size: int | None = None
    last_error: str | None = None


class WorkerPool:
    """Every prefill and decode server of one router, addressed by (role, index)."""

    def __init__(self, prefill: Sequence[PrefillEndpoint], decode: Sequence[str], initial: Health = Health.UNKNOWN):
        self._workers = {
            Role.PREFILL: [_Worker(p.url, p.bootstrap_port, initial) for p in prefill],
            Role.DECODE: [_Worker(url, None, initial) for url in decode],
        }

    def size(self, role: Role) -> int:
        """How many servers of `role` the router knows."""
        return len(self._workers[role])

    def loads(self, role: Role) -> list[ServerLoad]:
        """What the policy sees: an unhealthy server is not eligible."""
        return [ServerLoad(w.health is not Health.UNHEALTHY, w.in_flight) for w in self._workers[role]]

    def info(self, role: Role, index: int) -> WorkerInfo:
        """A snapshot of one server."""
        w = self._workers[role][index]
        return WorkerInfo(role, index, w.url, w.bootstrap_port, w.health, w.in_flight, w.dp_size, w.last_error)

    def infos(self, role: Role) -> list[WorkerInfo]:
        """Snapshots of every server of `role`, in command-line order."""
        return [self.info(role, i) for i in range(self.size(role))]

    def num_healthy(self, role: Role) -> int:
        """Servers whose last health check succeeded."""
        return sum(w.health is Health.HEALTHY for w in self._workers[role])

    def first_eligible(self, role: Role) -> int | None:
        """The first server the policy could pick (healthy first, then not-yet-checked)."""
        workers = self._workers[role]
        for wanted in (Health.HEALTHY, Health.UNKNOWN):
            for i, w in enumerate(workers):
                if w.health is wanted:
                    return i
        return None

    def set_health(self, role: Role, index: int, health: Health, error: str | None = None) -> Health:
        """Record a check's outcome; returns the previous state (callers log transitions)."""
        w = self._workers[role][index]
        previous, w.health = w.health, health
        w.last_error = error if health is Health.UNHEALTHY else None
        return previous

    def set_dp_size(self, role: Role, index: int, dp_size: int) -> None:
        """Record the dp_size the server reported in `/server_info`."""
        if dp_size < 1:
            raise ValueError(f"dp_size must be at least 1, got {dp_size}")
        self._workers[role][index].dp_size = dp_size

    def begin(self, role: Role, index: int) -> None:
        """A request starts on this server."""
        self._workers[role][index].in_flight += 1

    def end(self, role: Role, index: int) -> None:
        """A request on this server is over (answered, failed or cancelled)."""
        w = self._workers[role][index]
        assert w.in_flight > 0, f"{role} server {w.url}: request ended twice"
        w.in_flight -= 1
