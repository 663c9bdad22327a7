"""What a decode worker keeps for a request between its reservation and its KV's arrival, and the
fences of the ones that ended first. Plain state; the flows fill it in, the role reads it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING

from disagg.wire.engine_msgs import GenerateMsg

if TYPE_CHECKING:
    from decode.pull import Ticket
    from kvtransfer.checksum import LandedDigest


@dataclass
class PendingKV:
    msg: GenerateMsg
    ticket: Ticket | None  # pull flow: the prefill's ticket; None: the push flow
    started: float
    task: asyncio.Task | None = None  # the flow's fetch, while it runs
    client: object = None  # push flow: the ControlClient once the TransferInfo went out
    dst_block_ids: tuple[int, ...] = ()  # push flow: where the prefill writes (the KV checksum reads them)
    landed: LandedDigest | None = None  # --kv-checksum: what landed so far, digested piece by piece
    checked: bool = False  # its KV passed the checksum (or needs none) and waits for a slot (the decode's pace)
    read: object = None  # pull flow: our READ of the prefill's blocks, while it runs
    read_peer: str = ""  # ... and the backend peer it reads from
    read_s: float = 0.0  # ... and how long it took, once done
    lease: tuple | None = None  # pull flow: (ControlClient, remote request id) once we may hold a lease
    hold: asyncio.Task | None = None  # pull flow: the early claim of the lease (its answer)

    @property
    def room(self) -> int | None:
        return self.msg.bootstrap_room


class Fences:
    """Ended requests whose reserved blocks wait until no write of a prefill can land in them; a
    request's id comes out of `take()` once its blocks may go back to the pool."""

    def __init__(self, wake: Callable[[], None]):
        self.wake = wake
        self.tasks: dict[str, asyncio.Task] = {}
        self._fenced: list[str] = []

    def start(self, key: str, work: Coroutine) -> None:
        """Run `work` (which calls `fenced` when the blocks are safe) in the background under `key`."""
        self.tasks[key] = asyncio.create_task(self._run(key, work))

    async def _run(self, key: str, work: Coroutine) -> None:
        try:
            await work
        finally:
            self.tasks.pop(key, None)

    def fenced(self, request_id: str) -> None:
        self._fenced.append(request_id)
        self.wake()

    def take(self) -> list[str]:
        fenced, self._fenced = self._fenced, []
        return fenced

    def cancel(self) -> None:
        for task in list(self.tasks.values()):
            task.cancel()
