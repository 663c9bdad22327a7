"""The decode worker's connections to prefill servers: the registries requests name (a bounded LRU
cache, decode/registries.py) and one control stream per prefill rank.

Registries are named by requests, so their clients only read and never carry the cluster secret;
the control streams prove it (and check the prefill proves it back)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from decode.registries import Registries, Registry
from disagg.config import ControlConfig
from disagg.wire.control_msgs import PeerMsg
from kvtransfer.control.client import ControlClient
from kvtransfer.control.server import format_address


class PrefillPeers:
    def __init__(self, local: PeerMsg, control: ControlConfig = ControlConfig(), cluster_secret: str | None = None,
                 max_registries: int = 64):
        self.local = local
        self.control_config = control
        self._cluster_secret = cluster_secret
        self.registries = Registries(max_registries)
        self.clients: dict[tuple[str, int, int], ControlClient] = {}
        self._locks: dict[tuple, asyncio.Lock] = {}

    async def client(self, registry: Registry, dp_rank: int, deadline_s: float) -> ControlClient:
        """A live control stream to that prefill rank (reconnecting after a loss); `registry` (in
        use by the caller) tells where the rank listens.

        Push flow: the prefill writes into our blocks, so it loads our metadata (sent at
        registration); we need none of its own."""
        async def address() -> str:
            found = await registry.client.get_rank_address(dp_rank, deadline_s=deadline_s)
            return format_address(found.rank_ip, found.rank_port)

        return await self._live_client((registry.host, registry.port, dp_rank), address)

    async def client_at(self, host: str, port: int) -> ControlClient:
        """Pull flow: a live control stream to the prefill worker a ticket names (`remote_host`,
        `remote_port`: its control address), reconnecting after a loss."""
        async def address() -> str:
            return format_address(host, port)

        return await self._live_client((host, port, -1), address)

    async def _live_client(self, key: tuple[str, int, int], address: Callable[[], Awaitable[str]]) -> ControlClient:
        """The client cached under `key`, or, when it is missing or dead, a new one connected to
        `await address()` (one connect at a time per key)."""
        async with self._locks.setdefault(key, asyncio.Lock()):
            client = self.clients.get(key)
            if client is None or not client.is_alive:
                if client is not None:
                    await client.close()
                client = ControlClient(await address(), self.local, self.control_config, cluster_secret=self._cluster_secret)
                await client.connect()
                self.clients[key] = client
        return client

    async def close(self) -> None:
        for client in self.clients.values():
            await client.close()
        await self.registries.close()
