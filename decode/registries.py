"""The bootstrap registries a decode reads, one client (and its topology, once read) per host:port a
request names, in a bounded LRU cache: a client cannot be asked into existence without limit.

`InUseLru` is the pure bookkeeping: an entry in use by a request in flight is never evicted (the
cache then holds more than its capacity until those requests end); an idle one is evicted least
recently used first, and handed back to be closed. `Registries` closes what it evicts.
"""

from __future__ import annotations

import contextlib
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable, Hashable
from typing import Generic, TypeVar

from bootstrap.client import BootstrapClient
from disagg.wire.bootstrap_msgs import TopologyMsg

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class InUseLru(Generic[K, V]):
    """At most `capacity` values, least recently used first, plus those in use beyond it."""

    def __init__(self, capacity: int):
        assert capacity >= 1, capacity
        self.capacity = capacity
        self._values: OrderedDict[K, V] = OrderedDict()
        self._users: Counter[K] = Counter()

    def acquire(self, key: K, make: Callable[[], V]) -> tuple[V, list[V]]:
        """The value of `key` (made when missing), now in use and the most recent; and the idle
        values evicted to make room (the caller closes them)."""
        if key not in self._values:
            self._values[key] = make()
        self._values.move_to_end(key)
        self._users[key] += 1
        return self._values[key], self._evict()

    def release(self, key: K) -> list[V]:
        """One use of `key` ended; the idle values evicted now that it may be idle too."""
        assert self._users[key] > 0, f"{key!r} released more often than acquired"
        self._users[key] -= 1
        if not self._users[key]:
            del self._users[key]
        return self._evict()

    def _evict(self) -> list[V]:
        evicted = []
        for key in list(self._values):  # least recently used first
            if len(self._values) <= self.capacity:
                break
            if key not in self._users:
                evicted.append(self._values.pop(key))
        return evicted

    def take_all(self) -> list[V]:
        """Every value, the cache left empty (on close)."""
        values = list(self._values.values())
        self._values.clear()
        self._users.clear()
        return values

    def keys(self) -> list[K]:
        """The keys held, least recently used first."""
        return list(self._values)

    def num_in_use(self, key: K) -> int:
        """Requests in flight on `key`."""
        return self._users[key]


class Registry:
    """One registry a request named: its client, and its topology once read."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.client = BootstrapClient(host, port)
        self.closed = False
        self._topology: TopologyMsg | None = None

    async def topology(self, deadline_s: float) -> TopologyMsg:
        """The prefill server's shape (read once per client)."""
        if self._topology is None:
            self._topology = await self.client.get_topology(deadline_s=deadline_s)
        return self._topology

    async def close(self) -> None:
        self.closed = True
        await self.client.close()


class Registries:
    """The decode's registry clients, at most `capacity` idle ones kept open."""

    def __init__(self, capacity: int):
        self._lru: InUseLru[tuple[str, int], Registry] = InUseLru(capacity)

    @contextlib.asynccontextmanager
    async def using(self, host: str, port: int) -> AsyncIterator[Registry]:
        """The registry at host:port for one request's look-ups; it stays open while in use."""
        key = (host, port)
        registry, evicted = self._lru.acquire(key, lambda: Registry(host, port))
        try:
            await _close_all(evicted)
            yield registry
        finally:
            await _close_all(self._lru.release(key))

    def keys(self) -> list[tuple[str, int]]:
        """host:port of every registry held, least recently used first."""
        return self._lru.keys()

    async def close(self) -> None:
        await _close_all(self._lru.take_all())


async def _close_all(registries: list[Registry]) -> None:
    for registry in registries:
        await registry.close()
