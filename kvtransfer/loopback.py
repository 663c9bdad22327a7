"""In-process backend: endpoints on one LoopbackFabric copy host memory with ctypes.memmove.

The twin of the network backends for unit tests. A fabric can suspend an endpoint (its transfers
wait, like a stopped process) and an endpoint that closes fails the transfers aimed at it.
"""

from __future__ import annotations

import ctypes
import threading
from collections import deque
from dataclasses import dataclass

import numpy as np

from kvtransfer.base import (
    BackendUnavailable, KVLayout, Notification, PeerUnavailable, TransferHandle, TransferOp, TransferState,
)
from kvtransfer.core import BackendCore, drain
from kvtransfer.descriptors import BlockRun, host_view
from kvtransfer.handshake import PeerInfo
from kvtransfer.staging import Staged, stage


class LoopbackFabric:
    """The 'network' shared by the loopback endpoints of one process (pass the same one to each)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._endpoints: dict[str, LoopbackBackend] = {}
        self._suspended: set[str] = set()

    def attach(self, endpoint: LoopbackBackend) -> None:
        with self._lock:
            assert endpoint.agent_name not in self._endpoints, f"{endpoint.agent_name} attached twice"
            self._endpoints[endpoint.agent_name] = endpoint

    def detach(self, name: str) -> None:
        with self._lock:
            self._endpoints.pop(name, None)
            self._suspended.discard(name)

    def lookup(self, name: str) -> LoopbackBackend | None:
        """The live endpoint called `name`, or None once it closed."""
        with self._lock:
            return self._endpoints.get(name)

    def suspend(self, name: str) -> None:
        """Transfers to or from `name` wait until resume(name), like a stopped process."""
        with self._lock:
            self._suspended.add(name)

    def resume(self, name: str) -> None:
        with self._lock:
            self._suspended.discard(name)

    def is_suspended(self, name: str) -> bool:
        with self._lock:
            return name in self._suspended


@dataclass(frozen=True)
class _Pending:
    handle: TransferHandle
    runs: tuple[BlockRun, ...]
    tag: bytes
    staged: Staged | None = None  # between caches of different TP sizes: whole blocks through a buffer


class LoopbackBackend(BackendCore):
    backend_name = "loopback"

    def __init__(self, fabric: LoopbackFabric | None = None, agent_name: str | None = None) -> None:
        super().__init__(agent_name)
        self._fabric = fabric if fabric is not None else LoopbackFabric()
        self._inbox: deque[Notification] = deque()
        self._pending: dict[int, _Pending] = {}
        self._fabric.attach(self)

    @property
    def fabric(self) -> LoopbackFabric:
        return self._fabric

    def _on_register(self, layout: KVLayout) -> None:
        if layout.is_cuda:
            raise BackendUnavailable(
                f"the loopback backend copies host memory only, the layout is on {layout.device}; use nixl"
            )

    def _on_deregister(self) -> None:
        self._pending.clear()

    def _transport_info(self, info: PeerInfo) -> PeerInfo:
        return info

    def _on_add_peer(self, info: PeerInfo) -> None:
        self._target(info.name)

    def _on_remove_peer(self, peer: str) -> None:
        for transfer_id in [key for key, p in self._pending.items() if p.handle.peer == peer]:
            del self._pending[transfer_id]

    def _post(self, handle: TransferHandle, runs: list[BlockRun], notif_tag: bytes) -> None:
        self._pending[handle.transfer_id] = _Pending(handle, tuple(runs), notif_tag)
        self._progress(handle)

    def _post_slices(self, handle: TransferHandle, block_ids: tuple[list[int], list[int]], notif_tag: bytes) -> None:
        assert self._layout is not None
        region = np.frombuffer(host_view(self._layout), dtype=np.uint8)
        staged = stage(handle.op is TransferOp.WRITE, region, self._layout, self._peers[handle.peer].layout, block_ids)
        self._pending[handle.transfer_id] = _Pending(handle, (), notif_tag, staged)
        self._progress(handle)

    def _progress(self, handle: TransferHandle) -> None:
        pending = self._pending.get(handle.transfer_id)
        if pending is None:
            return
        target = self._fabric.lookup(handle.peer)
        if target is None or target.registered_layout is None:
            self._pending.pop(handle.transfer_id)
            self._transfers.fail(handle.transfer_id, f"peer {handle.peer!r} is closed")
            return
        if self._fabric.is_suspended(handle.peer) or self._fabric.is_suspended(self._agent_name):
            return
        del self._pending[handle.transfer_id]
        self._copy(target, pending)
        if self._transfers.advance(handle.transfer_id, TransferState.SUCCESS) and pending.tag:
            target._deliver(Notification(self._agent_name, pending.tag))

    def _copy(self, target: LoopbackBackend, pending: _Pending) -> None:
        local, remote = self._layout, target.registered_layout
        assert local is not None and remote is not None
        if pending.staged is not None:  # whole blocks between the buffer and the peer's region
            plan, buffer, finish = pending.staged
            for i, offset in enumerate(plan.remote_offsets.tolist()):
                ours, theirs = buffer.ctypes.data + i * plan.block_bytes, remote.base_address + offset
                src, dst = (ours, theirs) if finish is None else (theirs, ours)  # a WRITE, or a READ
                ctypes.memmove(dst, src, plan.block_bytes)
            if finish is not None:
                finish()
            return
        for run in pending.runs:
            size = run.num_blocks * local.block_size_bytes
            src, dst = local.block_address(run.local_start), remote.block_address(run.remote_start)
            if pending.handle.op is TransferOp.READ:
                src, dst = remote.block_address(run.remote_start), local.block_address(run.local_start)
            ctypes.memmove(dst, src, size)

    def _cancel(self, handle: TransferHandle) -> None:
        self._pending.pop(handle.transfer_id, None)

    def _deliver(self, notification: Notification) -> None:
        self._inbox.append(notification)

    def _drain_notifications(self) -> list[Notification]:
        return drain(self._inbox)

    def _send_notification(self, peer: str, tag: bytes) -> None:
        self._target(peer)._deliver(Notification(self._agent_name, tag))

    def _target(self, name: str) -> LoopbackBackend:
        target = self._fabric.lookup(name)
        if target is None:
            raise PeerUnavailable(f"peer {name!r} is not on this loopback fabric (closed?)")
        return target

    def _on_close(self) -> None:
        self._fabric.detach(self._agent_name)
