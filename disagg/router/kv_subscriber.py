"""The router's KV-event subscriptions (`--prefill-kv-events`): one ZMQ SUB socket per prefill DP
worker, at the server's endpoint with the port plus the rank (as the workers publish), every batch
applied to the KV index under (server id, rank). A late subscriber starts from the next batch (the
replay socket is not asked); a tenant counts for picking once its first batch arrived.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec
import structlog
import zmq
import zmq.asyncio

from disagg.kv_events_config import offset_endpoint
from disagg.router.kv_index import KVIndex
from disagg.wire.kv_events import decode_batch

log = structlog.get_logger("disagg.router")


class KVEventSubscriber:
    def __init__(self, index: KVIndex, topic: str = "", on_batch: Callable[[], None] = lambda: None):
        self.index = index
        self.topic = topic.encode()
        self.on_batch = on_batch
        self._context = zmq.asyncio.Context()
        self._tasks: dict[tuple[int, int], asyncio.Task] = {}

    def watched(self, server_id: int) -> bool:
        return any(key[0] == server_id for key in self._tasks)

    def servers(self) -> set[int]:
        """The servers subscribed to."""
        return {key[0] for key in self._tasks}

    def watch(self, server_id: int, endpoint: str, dp_size: int) -> None:
        """Subscribe to every DP worker of one prefill server (already watched ones are left as they are)."""
        for rank in range(dp_size):
            if (server_id, rank) not in self._tasks:
                address = offset_endpoint(endpoint, rank)
                self._tasks[server_id, rank] = asyncio.create_task(self._receive((server_id, rank), address))
                log.info("subscribed to kv events", server_id=server_id, dp_rank=rank, endpoint=address)

    def unwatch(self, server_id: int) -> None:
        """Stop a server's subscriptions and forget what its workers held."""
        for key in [k for k in self._tasks if k[0] == server_id]:
            self._tasks.pop(key).cancel()
            self.index.forget(key)

    async def _receive(self, tenant: tuple[int, int], address: str) -> None:
        sock = self._context.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic)
        sock.connect(address)
        try:
            while True:
                frames = await sock.recv_multipart()
                try:
                    batch = decode_batch(frames[-1])
                except msgspec.DecodeError as exc:  # one bad batch never stops the stream
                    log.warning("undecodable kv event batch", endpoint=address, error=str(exc))
                    continue
                self.index.apply(tenant, batch)
                self.on_batch()
        finally:
            sock.close()

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._context.term()
