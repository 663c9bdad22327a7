"""The decode worker's connections to prefill servers: the registries requests name (a bounded LRU
cache, decode/registries.py) and one control stream per prefill worker, whichever flow asks.

Registries are named by requests, so their clients only read and never carry the cluster secret;
the control streams prove it (and check the prefill proves it back)."""

from __future__ import annotations

import asyncio

from decode.registries import Registries, Registry
from disagg.pd_config import ControlConfig
from disagg.wire.auth import format_address
from disagg.wire.control_msgs import PeerMsg
from kvtransfer.control.client import ControlClient


class PrefillPeers:
    def __init__(self, local: PeerMsg, control: ControlConfig = ControlConfig(), cluster_secret: str | None = None,
                 max_registries: int = 64):
        self.local = local
        self.control_config = control
        self._cluster_secret = cluster_secret
        self.registries = Registries(max_registries)
        self.addresses: dict[tuple[str, int, int], str] = {}  # (registry host, port, prefill DP rank) -> control address
        self.clients: dict[str, ControlClient] = {}  # control address -> its stream
        self._locks: dict[str, asyncio.Lock] = {}

    async def client(self, registry: Registry, dp_rank: int, deadline_s: float) -> ControlClient:
        """A live control stream to that prefill rank (reconnecting after a loss, at the address the
        registry gives then); `registry` is in use by the caller.

        Push flow: the prefill writes into our blocks, so it loads our metadata (sent at
        registration); we need none of its own."""
        known = self.cached(registry.host, registry.port, dp_rank)
        if known is not None:
            return known
        found = await registry.client.get_rank_address(dp_rank, deadline_s=deadline_s)
        key = (registry.host, registry.port, dp_rank)
        self.addresses[key] = format_address(found.rank_ip, found.rank_port)
        return await self._live_client(self.addresses[key])

    def cached(self, host: str, port: int, dp_rank: int) -> ControlClient | None:
        """The live stream to that prefill rank, if one is open."""
        client = self.clients.get(self.addresses.get((host, port, dp_rank), ""))
        return client if client is not None and client.is_alive else None

    async def client_at(self, host: str, port: int) -> ControlClient:
        """Pull flow: a live control stream to the prefill worker a ticket names (`remote_host`,
        `remote_port`: its control address), reconnecting after a loss."""
        return await self._live_client(format_address(host, port))

    async def _live_client(self, address: str) -> ControlClient:
        """The client of `address`, or, when it is missing or dead, a new one (one connect at a time
        per address). One stream per prefill worker, whichever flow asks: a second registration of
        this decode on another stream would end the first."""
        async with self._locks.setdefault(address, asyncio.Lock()):
            client = self.clients.get(address)
            if client is None or not client.is_alive:
                if client is not None:
                    await client.close()
                client = ControlClient(address, self.local, self.control_config, cluster_secret=self._cluster_secret)
                await client.connect()
                self.clients[address] = client
        return client

    async def close(self) -> None:
        for client in self.clients.values():
            await client.close()
        await self.registries.close()
