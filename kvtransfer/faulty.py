"""Transfer faults on purpose (a server's `--enable-fault-injection`, docs/testing.md): a backend
whose next transfers report success late or fail, and a worker's heartbeats switched off.

`FaultyBackend` wraps any backend. A delayed transfer moves its bytes at once but polls in progress
until its delay has passed, so whoever waits for it (the prefill's SUCCESS, the decode's READ)
waits that long; a failed one moves nothing and polls FAILED. `pause_heartbeats(s)`: for `s`
seconds this process's control clients send no heartbeat and its control server acks none, so its
peers count misses and drop it, as they would a hung worker.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

from disagg.wire.states import TransferState
from kvtransfer.base import KVTransferBackend, TransferHandle, TransferOp, TransferStatus

INJECTED = "injected fault: transfer failed"
_heartbeats_paused_until = 0.0


def pause_heartbeats(seconds: float) -> None:
    global _heartbeats_paused_until
    _heartbeats_paused_until = time.monotonic() + seconds


def heartbeats_paused() -> bool:
    return time.monotonic() < _heartbeats_paused_until


class FaultyBackend:
    """`inner` with `delay(count, seconds)` and `fail(count)` for its next writes and reads."""

    def __init__(self, inner: KVTransferBackend):
        self.inner = inner
        self._delays: list[float] = []  # one entry per next transfer to delay
        self._failures = 0
        self._corruptions = 0  # rooms to land corrupted (corrupt_transfers)
        self._ready_at: dict[int, float] = {}  # delayed handles -> when they may report success
        self._failed: set[int] = set()
        self._fake_ids = itertools.count(-1, -1)  # handles of failed transfers: never the inner's ids

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def delay(self, count: int, seconds: float) -> None:
        self._delays += [seconds] * count

    def fail(self, count: int) -> None:
        self._failures += count

    def corrupt(self, count: int) -> None:
        """The next `count` rooms that land here get one byte flipped before they are checked
        (--kv-checksum: the decode takes them with `take_corruption`)."""
        self._corruptions += count

    def take_corruption(self) -> bool:
        """True (once per corruption asked for) when the room that just landed is to be corrupted."""
        if self._corruptions <= 0:
            return False
        self._corruptions -= 1
        return True

    def write(self, peer: str, local_block_ids: Sequence[int], remote_block_ids: Sequence[int], *args, **kwargs):
        return self._posted(TransferOp.WRITE, peer, local_block_ids, remote_block_ids, args, kwargs)

    def read(self, peer: str, local_block_ids: Sequence[int], remote_block_ids: Sequence[int], *args, **kwargs):
        return self._posted(TransferOp.READ, peer, local_block_ids, remote_block_ids, args, kwargs)

    def _posted(self, op: TransferOp, peer: str, local, remote, args, kwargs) -> TransferHandle:
        if self._failures:
            self._failures -= 1
            handle = TransferHandle(next(self._fake_ids), peer, op, len(local), 0)
            self._failed.add(handle.transfer_id)
            return handle
        post = self.inner.write if op is TransferOp.WRITE else self.inner.read
        handle = post(peer, local, remote, *args, **kwargs)
        if self._delays:
            self._ready_at[handle.transfer_id] = time.monotonic() + self._delays.pop(0)
        return handle

    def poll(self, handle: TransferHandle) -> TransferStatus:
        if handle.transfer_id in self._failed:
            return TransferStatus(TransferState.FAILED, INJECTED)
        status = self.inner.poll(handle)
        ready_at = self._ready_at.get(handle.transfer_id)
        if ready_at is not None and status.ok and time.monotonic() < ready_at:
            return TransferStatus(TransferState.TRANSFERRING)
        return status

    def release(self, handle: TransferHandle) -> None:
        self._ready_at.pop(handle.transfer_id, None)
        if handle.transfer_id in self._failed:
            self._failed.discard(handle.transfer_id)
            return
        self.inner.release(handle)

    def abort(self, handle: TransferHandle, reason: str = "") -> None:
        if handle.transfer_id in self._failed:
            return
        self.inner.abort(handle, reason)
